/* A small JSON writer for the agent's answers: one object per answer, grown as needed. */
#ifndef GPUCR_JSON_H
#define GPUCR_JSON_H
#include <stdbool.h>
#include <stddef.h>

struct jb { char *buf; size_t len, cap; bool first, oom; };
void jb_open(struct jb *j);                 /* start a new answer: "{" */
void jb_close(struct jb *j);                /* finish it: "}\n" */
void jb_free(struct jb *j);
void jb_str(struct jb *j, const char *k, const char *v);
void jb_int(struct jb *j, const char *k, long long v);
void jb_dbl(struct jb *j, const char *k, double v);
void jb_bool(struct jb *j, const char *k, bool v);
void jb_sub(struct jb *j, const char *k);   /* "k": {   (k NULL inside an array) */
void jb_end(struct jb *j);                  /* } */
void jb_arr(struct jb *j, const char *k);   /* "k": [ */
void jb_arr_end(struct jb *j);              /* ] */
void jb_error(struct jb *j, const char *msg);   /* a whole answer {"ok":false,"error":msg} */
#endif
