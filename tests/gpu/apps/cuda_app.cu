// A plain C++ CUDA program, built by nvcc with the CUDA runtime linked statically (nvcc's default),
// for the GPU tests: gpucr must take it unchanged. It holds cudaMalloc buffers of several sizes
// (converted to VMM by the agent, or left native when small), stream-ordered pool memory, pinned
// host memory and a captured CUDA graph, and answers one command per line on stdin with one JSON
// line on stdout:
//   digest        a checksum of every buffer (computed on the GPU) and its address
//   work          add 3 to every word of every buffer, then subtract 3 (the digest must not change)
//   graph N       replay a graph that adds 1 then subtracts 1 on buffer 0, N times
//   reset         cudaDeviceReset (every allocation, stream and graph gone), then all made again
//   quit
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <cuda_runtime.h>

#include "kernels.cuh"

struct Buf { unsigned *p; size_t bytes; };

static std::vector<Buf> bufs;
static cudaStream_t s;
static unsigned long long *sums;
static cudaGraphExec_t ge;

// Everything the program holds on the GPU, made (again) from nothing, with the same contents.
static void setup()
{
    const size_t sizes[] = {256u << 20, 64u << 20, 3u << 20, 100u << 10, 1000};
    bufs.clear();
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        Buf b{nullptr, sizes[i]};
        CHECK(cudaMalloc(&b.p, b.bytes));
        bufs.push_back(b);
    }
    Buf pool{nullptr, 32u << 20};
    CHECK(cudaMallocAsync(&pool.p, pool.bytes, s));   // stream-ordered: left to the driver's checkpoint
    bufs.push_back(pool);
    for (size_t i = 0; i < bufs.size(); i++) fill<<<256, 256, 0, s>>>(bufs[i].p, bufs[i].bytes / 4, 7u * i + 1);
    CHECK(cudaMallocHost(&sums, sizeof *sums * bufs.size()));
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    add<<<256, 256, 0, s>>>(bufs[0].p, bufs[0].bytes / 4, 1u);
    add<<<256, 256, 0, s>>>(bufs[0].p, bufs[0].bytes / 4, ~0u);   // + (2^32 - 1) = - 1
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    CHECK(cudaStreamSynchronize(s));
}

int main()
{
    setup();
    printf("{\"ready\": true, \"runtime\": %d}\n", CUDART_VERSION);
    fflush(stdout);

    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        std::string cmd(line);
        if (cmd.rfind("digest", 0) == 0) {
            unsigned long long *dev;
            CHECK(cudaMalloc(&dev, sizeof *dev * bufs.size()));
            CHECK(cudaMemsetAsync(dev, 0, sizeof *dev * bufs.size(), s));
            for (size_t i = 0; i < bufs.size(); i++) checksum<<<256, 256, 0, s>>>(bufs[i].p, bufs[i].bytes / 4, dev + i);
            CHECK(cudaMemcpyAsync(sums, dev, sizeof *sums * bufs.size(), cudaMemcpyDeviceToHost, s));
            CHECK(cudaStreamSynchronize(s));
            CHECK(cudaFree(dev));
            print_digest(sums, bufs);
        } else if (cmd.rfind("work", 0) == 0) {
            for (auto &b : bufs) add<<<256, 256, 0, s>>>(b.p, b.bytes / 4, 3u);
            for (auto &b : bufs) add<<<256, 256, 0, s>>>(b.p, b.bytes / 4, ~2u);   // - 3
            CHECK(cudaStreamSynchronize(s));
            printf("{\"done\": true}\n");
        } else if (cmd.rfind("graph", 0) == 0) {
            int n = atoi(cmd.c_str() + 5);
            for (int i = 0; i < n; i++) CHECK(cudaGraphLaunch(ge, s));
            CHECK(cudaStreamSynchronize(s));
            printf("{\"replayed\": %d}\n", n);
        } else if (cmd.rfind("reset", 0) == 0) {
            CHECK(cudaDeviceReset());
            setup();
            printf("{\"reset\": true}\n");
        } else if (cmd.rfind("quit", 0) == 0) {
            break;
        } else {
            printf("{\"error\": \"unknown command\"}\n");
        }
        fflush(stdout);
    }
    return 0;
}
