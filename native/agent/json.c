#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "json.h"

static void raw(struct jb *j, const char *s, size_t n)
{
    if (j->oom) return;
    if (j->len + n + 1 > j->cap) {
        size_t cap = j->cap ? j->cap : 4096;
        while (j->len + n + 1 > cap) cap *= 2;
        char *b = realloc(j->buf, cap);
        if (!b) { j->oom = true; return; }
        j->buf = b;
        j->cap = cap;
    }
    memcpy(j->buf + j->len, s, n);
    j->len += n;
    j->buf[j->len] = 0;
}
static void raws(struct jb *j, const char *s) { raw(j, s, strlen(s)); }

static void key(struct jb *j, const char *k)
{
    if (!j->first) raws(j, ",");
    j->first = false;
    if (!k) return;
    raws(j, "\"");
    raws(j, k);
    raws(j, "\":");
}

void jb_open(struct jb *j) { j->len = 0; j->oom = false; j->first = true; raws(j, "{"); }
void jb_close(struct jb *j)
{
    if (j->oom) { j->oom = false; jb_error(j, "out of memory building the answer"); }
    raws(j, "}\n");
}
void jb_free(struct jb *j) { free(j->buf); j->buf = NULL; j->len = j->cap = 0; }

void jb_str(struct jb *j, const char *k, const char *v)
{
    key(j, k);
    raws(j, "\"");
    char esc[8];
    for (const unsigned char *p = (const unsigned char *)v; *p; p++) {
        if (*p == '"' || *p == '\\') { esc[0] = '\\'; esc[1] = (char)*p; esc[2] = 0; }
        else if (*p < 0x20 || *p >= 0x7f) snprintf(esc, sizeof esc, "\\u%04x", *p);
        else { esc[0] = (char)*p; esc[1] = 0; }
        raws(j, esc);
    }
    raws(j, "\"");
}
void jb_int(struct jb *j, const char *k, long long v) { char s[32]; snprintf(s, sizeof s, "%lld", v); key(j, k); raws(j, s); }
void jb_dbl(struct jb *j, const char *k, double v) { char s[32]; snprintf(s, sizeof s, "%.3f", v); key(j, k); raws(j, s); }
void jb_bool(struct jb *j, const char *k, bool v) { key(j, k); raws(j, v ? "true" : "false"); }
void jb_sub(struct jb *j, const char *k) { key(j, k); raws(j, "{"); j->first = true; }
void jb_end(struct jb *j) { raws(j, "}"); j->first = false; }
void jb_arr(struct jb *j, const char *k) { key(j, k); raws(j, "["); j->first = true; }
void jb_arr_end(struct jb *j) { raws(j, "]"); j->first = false; }
void jb_error(struct jb *j, const char *msg) { jb_open(j); jb_bool(j, "ok", false); jb_str(j, "error", msg); }
