#include <stdlib.h>
#include "hmap.h"

#define TOMB UINT64_MAX   /* a deleted slot: lookups go on past it */

static size_t slot_of(uint64_t key, size_t cap)
{
    key ^= key >> 33; key *= 0xff51afd7ed558ccdULL; key ^= key >> 33;
    return (size_t)key & (cap - 1);
}

void *hmap_get(const struct hmap *m, uint64_t key)
{
    if (!m->cap || key == 0 || key == TOMB) return NULL;
    for (size_t i = slot_of(key, m->cap), n = 0; n < m->cap; i = (i + 1) & (m->cap - 1), n++) {
        if (m->keys[i] == key) return m->vals[i];
        if (m->keys[i] == 0) return NULL;
    }
    return NULL;
}

static int grow(struct hmap *m)
{
    size_t cap = m->cap ? m->cap * 2 : 64;
    struct hmap n = {calloc(cap, sizeof(uint64_t)), calloc(cap, sizeof(void *)), cap, 0, 0};
    if (!n.keys || !n.vals) { free(n.keys); free(n.vals); return -1; }
    for (size_t i = 0; i < m->cap; i++)
        if (m->keys[i] && m->keys[i] != TOMB) hmap_put(&n, m->keys[i], m->vals[i]);   /* n has room: cannot fail */
    free(m->keys); free(m->vals);
    *m = n;
    return 0;
}

int hmap_put(struct hmap *m, uint64_t key, void *val)
{
    if (key == 0 || key == TOMB) return -1;
    if ((m->used + 1) * 4 >= m->cap * 3 && grow(m)) return -1;
    size_t tomb = SIZE_MAX;
    for (size_t i = slot_of(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == key) { m->vals[i] = val; return 0; }
        if (m->keys[i] == TOMB && tomb == SIZE_MAX) tomb = i;
        if (m->keys[i] == 0) {
            if (tomb != SIZE_MAX) i = tomb; else m->used++;
            m->keys[i] = key; m->vals[i] = val; m->len++;
            return 0;
        }
    }
}

void *hmap_del(struct hmap *m, uint64_t key)
{
    if (!m->cap || key == 0 || key == TOMB) return NULL;
    for (size_t i = slot_of(key, m->cap), n = 0; n < m->cap; i = (i + 1) & (m->cap - 1), n++) {
        if (m->keys[i] == key) { void *v = m->vals[i]; m->keys[i] = TOMB; m->vals[i] = NULL; m->len--; return v; }
        if (m->keys[i] == 0) return NULL;
    }
    return NULL;
}

void hmap_clear(struct hmap *m) { free(m->keys); free(m->vals); m->keys = NULL; m->vals = NULL; m->cap = m->len = m->used = 0; }

size_t hmap_next(const struct hmap *m, size_t i, uint64_t *key, void **val)
{
    for (; i < m->cap; i++)
        if (m->keys[i] && m->keys[i] != TOMB) { *key = m->keys[i]; *val = m->vals[i]; return i; }
    return m->cap;
}
