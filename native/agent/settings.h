/* The agent's settings (environment variables), all listed in settings.def: each is read and
 * checked once, at load, so a bad value is reported when the process starts (one line on stderr,
 * the default kept), and later changes to the application's environment do not reach the agent. */
#ifndef GPUCR_SETTINGS_H
#define GPUCR_SETTINGS_H
#include <stdbool.h>

enum gpucr_setting {
#define S(id, name, kind, dflt, min, max, accepted, meaning) SET_##id,
#include "settings.def"
#undef S
    SET_COUNT
};

/* An integer or 0/1 setting: its value, or the table's default when unset or refused. */
long long gpucr_setting_int(enum gpucr_setting id);
bool gpucr_setting_on(enum gpucr_setting id);
/* A word, text or path setting: its value, or the table's default ("" for none). */
const char *gpucr_setting_str(enum gpucr_setting id);
/* Read and check every setting (once; each accessor does it on first use too). */
void gpucr_settings_load(void);
/* GPUCR_HOST_BUDGET's form: bytes, a size with K, M, G or T (binary), or 1% to 100% (of MemTotal;
 * *pct set, *bytes 0). Strict: no sign, no spaces, one suffix at most. */
bool gpucr_parse_budget(const char *v, unsigned long long *bytes, int *pct);
#endif
