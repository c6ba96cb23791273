/* The rules gpucr's controller (Python) must follow exactly as the agent does, as data, in this one place:
 * the agent's code expands these macros, and src/gpucr/agent_tables.py is generated from them (and from
 * settings.def) by scripts/gen-agent-tables; tests/test_agent_tables.py fails, naming that command, until it
 * is run after a change here. Every value is a C literal: both sides read it through the C preprocessor.
 *
 * GPUCR_RUNTIME_DIRS(RULE)   where the control sockets (and the host-memory ledger) live: the first
 *     RULE(SETTING, SUFFIX) whose SETTING is set, not empty, names the dir, its value followed by SUFFIX. A dir
 *     that is not private to the process's user (a directory, not a link, of this user, mode 0700) is
 *     refused: the channel is off.
 * GPUCR_RUNTIME_DIR_DEFAULT_PARENT, _NAME   with no SETTING set: PARENT/NAME, NAME a printf format of the
 *     user's uid. Anyone may take that name first: where it is not private, the agent listens in the first
 *     private PARENT/NAME.* in name order, else in one it makes (mkdtemp); the controller looks there too.
 * GPUCR_UUID_TEXT   a GPU's 16-byte UUID as text, as nvidia-smi -L prints it: a printf format of its bytes.
 */
#ifndef GPUCR_RULES_H
#define GPUCR_RULES_H

#define GPUCR_RUNTIME_DIRS(RULE) \
    RULE("GPUCR_RUNTIME_DIR", "") \
    RULE("XDG_RUNTIME_DIR", "/gpucr")
#define GPUCR_RUNTIME_DIR_DEFAULT_PARENT "/tmp"
#define GPUCR_RUNTIME_DIR_DEFAULT_NAME "gpucr-%u"

#define GPUCR_UUID_TEXT "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x"

#endif
