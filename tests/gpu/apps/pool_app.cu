// A C++ CUDA program that takes its memory from CUDA's stream-ordered allocator, for the GPU tests of
// gpucr's pools (nvcc, the runtime linked statically): cudaMallocAsync buffers on several streams, an
// explicit pool (cudaMemPoolCreate) and a CUDA graph with memory nodes (cudaMallocAsync/cudaFreeAsync
// captured: the graph allocates on every launch). One command per line on stdin, one JSON line out:
//   digest        a checksum of every buffer (computed on the GPU) and its address
//   work          add 3 then subtract 3 on every buffer, each on its own stream (the digest must not change)
//   graph N       replay the graph N times: it allocates a scratch buffer, fills it, adds its checksum
//                 to a counter and frees it; answers whether the counter is N times one checksum
//   churn N       on every stream, N rounds of: allocate (sizes 1 KiB .. 8 MiB), fill, check, free,
//                 with the next allocation on another stream: stream-ordered reuse under kernels
//   loop start    a thread replaying the graph and churning until `loop stop` (the checkpoint lands
//   loop stop     mid-loop); stop answers the iterations and whether every check held
//   quit
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#include <cuda_runtime.h>

#include "kernels.cuh"

// counts the words that differ from fill(seed): a reused block must hold what its new owner wrote
__global__ void verify(const unsigned *p, size_t n, unsigned seed, unsigned long long *bad)
{
    unsigned long long b = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        b += p[i] != ((unsigned)(i * 2654435761u) ^ seed);
    if (b) atomicAdd(bad, b);
}

struct Buf { unsigned *p; size_t bytes; cudaStream_t s; };

static const int NSTREAMS = 4;
static cudaStream_t streams[NSTREAMS];
static std::vector<Buf> bufs;
static cudaMemPool_t pool;
static cudaGraphExec_t ge;
static unsigned long long *graph_sum, *scratch_sum, *bad;   // device counters
static const size_t SCRATCH = 4u << 20;

static void setup()
{
    for (int i = 0; i < NSTREAMS; i++) CHECK(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
    cudaMemPool_t dflt;
    CHECK(cudaDeviceGetDefaultMemPool(&dflt, 0));
    unsigned long long keep = ~0ull;   // keep what is reserved between synchronises, as PyTorch does
    CHECK(cudaMemPoolSetAttribute(dflt, cudaMemPoolAttrReleaseThreshold, &keep));
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = 0;
    CHECK(cudaMemPoolCreate(&pool, &props));
    const size_t sizes[] = {256u << 20, 128u << 20, 3u << 20, 100u << 10, 1000};
    for (int i = 0; i < NSTREAMS; i++)
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            Buf b{nullptr, sizes[k] / (i + 1), streams[i]};
            CHECK(cudaMallocAsync(&b.p, b.bytes, b.s));
            bufs.push_back(b);
        }
    for (size_t k = 0; k < 2; k++) {   // the explicit pool: 64 MiB and 1 MiB
        Buf b{nullptr, k ? 1u << 20 : 64u << 20, streams[k]};
        CHECK(cudaMallocFromPoolAsync(&b.p, b.bytes, pool, b.s));
        bufs.push_back(b);
    }
    for (size_t i = 0; i < bufs.size(); i++) fill<<<256, 256, 0, bufs[i].s>>>(bufs[i].p, bufs[i].bytes / 4, 7u * i + 1);
    CHECK(cudaMalloc(&graph_sum, 3 * sizeof(unsigned long long)));
    scratch_sum = graph_sum + 1;
    bad = graph_sum + 2;
    CHECK(cudaMemset(graph_sum, 0, 3 * sizeof(unsigned long long)));
    // the graph: memory nodes (the allocation is the graph's, made on each launch) around two kernels
    cudaStream_t s = streams[0];
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    unsigned *tmp;
    CHECK(cudaMallocAsync(&tmp, SCRATCH, s));
    fill<<<256, 256, 0, s>>>(tmp, SCRATCH / 4, 99u);
    checksum<<<256, 256, 0, s>>>(tmp, SCRATCH / 4, graph_sum);
    CHECK(cudaFreeAsync(tmp, s));
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    // one checksum of the scratch contents, to check the graph's counter against
    unsigned *ref;
    CHECK(cudaMallocAsync(&ref, SCRATCH, s));
    fill<<<256, 256, 0, s>>>(ref, SCRATCH / 4, 99u);
    checksum<<<256, 256, 0, s>>>(ref, SCRATCH / 4, scratch_sum);
    CHECK(cudaFreeAsync(ref, s));
    CHECK(cudaDeviceSynchronize());
}

static unsigned long long read_counter(const unsigned long long *p, cudaStream_t s)
{
    unsigned long long v;
    CHECK(cudaMemcpyAsync(&v, p, sizeof v, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    return v;
}

static std::atomic<long long> replays{0};

static bool replay(int n, cudaStream_t s)
{
    for (int i = 0; i < n; i++) CHECK(cudaGraphLaunch(ge, s));
    replays += n;
    CHECK(cudaStreamSynchronize(s));
    return read_counter(graph_sum, s) == (unsigned long long)replays.load() * read_counter(scratch_sum, s);
}

// allocations that move between streams: each round allocates on stream i, fills, verifies, and frees
// on stream (i + 1): the next allocation on any stream may get the block only once the free is ordered
static bool churn(int rounds, int first)
{
    const size_t sizes[] = {1u << 10, 64u << 10, 1u << 20, 3u << 20, 8u << 20};
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < NSTREAMS; i++) {
            cudaStream_t a = streams[(first + i) % NSTREAMS], b = streams[(first + i + 1) % NSTREAMS];
            size_t n = sizes[(r + i) % 5];
            unsigned seed = (unsigned)(r * 131 + i), *p;
            CHECK(cudaMallocAsync(&p, n, a));
            fill<<<64, 256, 0, a>>>(p, n / 4, seed);
            verify<<<64, 256, 0, a>>>(p, n / 4, seed, bad);
            cudaEvent_t ev;
            CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
            CHECK(cudaEventRecord(ev, a));
            CHECK(cudaStreamWaitEvent(b, ev, 0));   // the free on b follows the work on a
            CHECK(cudaFreeAsync(p, b));
            CHECK(cudaEventDestroy(ev));
        }
    CHECK(cudaDeviceSynchronize());
    return read_counter(bad, streams[0]) == 0;
}

int main()
{
    setup();
    printf("{\"ready\": true, \"runtime\": %d, \"buffers\": %zu}\n", CUDART_VERSION, bufs.size());
    fflush(stdout);
    std::thread loop;
    std::atomic<bool> stop{false}, loop_ok{true};
    std::atomic<long> iters{0};
    unsigned long long *sums;
    CHECK(cudaMallocHost(&sums, sizeof *sums * bufs.size()));
    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        std::string cmd(line);
        if (cmd.rfind("digest", 0) == 0) {
            unsigned long long *dev;
            cudaStream_t s = streams[0];
            CHECK(cudaDeviceSynchronize());
            CHECK(cudaMallocAsync(&dev, sizeof *dev * bufs.size(), s));
            CHECK(cudaMemsetAsync(dev, 0, sizeof *dev * bufs.size(), s));
            for (size_t i = 0; i < bufs.size(); i++) checksum<<<256, 256, 0, s>>>(bufs[i].p, bufs[i].bytes / 4, dev + i);
            CHECK(cudaMemcpyAsync(sums, dev, sizeof *sums * bufs.size(), cudaMemcpyDeviceToHost, s));
            CHECK(cudaFreeAsync(dev, s));
            CHECK(cudaStreamSynchronize(s));
            print_digest(sums, bufs);
        } else if (cmd.rfind("work", 0) == 0) {
            for (auto &b : bufs) add<<<256, 256, 0, b.s>>>(b.p, b.bytes / 4, 3u);
            for (auto &b : bufs) add<<<256, 256, 0, b.s>>>(b.p, b.bytes / 4, ~2u);   // - 3
            CHECK(cudaDeviceSynchronize());
            printf("{\"done\": true}\n");
        } else if (cmd.rfind("graph", 0) == 0) {
            int n = atoi(cmd.c_str() + 5);
            printf("{\"replayed\": %d, \"ok\": %s}\n", n, replay(n, streams[0]) ? "true" : "false");
        } else if (cmd.rfind("churn", 0) == 0) {
            printf("{\"ok\": %s}\n", churn(atoi(cmd.c_str() + 5), 0) ? "true" : "false");
        } else if (cmd.rfind("loop start", 0) == 0) {
            stop = false;
            iters = 0;
            loop = std::thread([&] {
                while (!stop) {
                    if (!replay(1, streams[1]) || !churn(1, (int)(iters % NSTREAMS))) loop_ok = false;
                    iters++;
                }
            });
            printf("{\"started\": true}\n");
        } else if (cmd.rfind("loop stop", 0) == 0) {
            stop = true;
            loop.join();
            printf("{\"iterations\": %ld, \"ok\": %s}\n", iters.load(), loop_ok ? "true" : "false");
        } else if (cmd.rfind("quit", 0) == 0) {
            break;
        } else {
            printf("{\"error\": \"unknown command\"}\n");
        }
        fflush(stdout);
    }
    return 0;
}
