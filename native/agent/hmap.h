/* A small open-addressing hash map from 64-bit keys (addresses, handles) to pointers. Key 0 is
 * reserved. Not thread-safe: the registry lock guards it. */
#ifndef GPUCR_HMAP_H
#define GPUCR_HMAP_H
#include <stddef.h>
#include <stdint.h>

struct hmap { uint64_t *keys; void **vals; size_t cap, len, used; };
void *hmap_get(const struct hmap *m, uint64_t key);
int hmap_put(struct hmap *m, uint64_t key, void *val);   /* 0, or -1 out of memory */
void *hmap_del(struct hmap *m, uint64_t key);
void hmap_clear(struct hmap *m);
/* Iteration: for (size_t i = 0; (i = hmap_next(m, i, &k, &v)) < m->cap; i++) visits every entry;
 * deleting the entry just visited is allowed. */
size_t hmap_next(const struct hmap *m, size_t i, uint64_t *key, void **val);
#endif
