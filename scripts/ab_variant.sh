#!/usr/bin/env bash
# scripts/ab_variant.sh — a second gmoe-bench whose given translation units see older headers, for
# timing a header change against the code before it in one device call (same GPU, same session).
#
#   scripts/ab_variant.sh BUILD_DIR SHADOW_DIR OUT_BIN TU...
#
# SHADOW_DIR holds headers laid out as under src/ (e.g. SHADOW_DIR/cuda/elementwise/fp8_quantize.cuh,
# from `git show REV:src/cuda/elementwise/fp8_quantize.cuh`); it is searched before src/. Each TU (a
# path under src/, e.g. cuda/elementwise/fp8_quantize_grouped.cu) is compiled with BUILD_DIR's own
# command, its object replaces the member of a copy of BUILD_DIR/libgmoe.a, and gmoe-bench is linked
# again as OUT_BIN. Nothing in BUILD_DIR changes. Works on a build made here and carried
# (GMOE_BUILD_DIR) or one made on the GPU machine; `git diff --stat REV -- src/` tells which TUs a
# header reaches.
set -euo pipefail
[ $# -ge 4 ] || { sed -n 2,12p "$0"; exit 2; }
B=$(cd "$1" && pwd); SHADOW=$(cd "$2" && pwd); OUTB=$3; shift 3
W=$(mktemp -d)
python3 - "$B" "$SHADOW" "$W" "$@" <<'PY'
import json, shlex, sys
build, shadow, work, tus = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
cmds = []
for e in json.load(open(build + "/compile_commands.json")):
    tu = next((t for t in tus if e["file"].endswith("/src/" + t)), None)
    if tu is None:
        continue
    a = shlex.split(e["command"])
    a[a.index("-o") + 1] = f"{work}/{tu.split('/')[-1]}.o"
    a.insert(next(k for k, x in enumerate(a) if x.startswith("-I")), "-I" + shadow)
    cmds.append(f"(cd {shlex.quote(e['directory'])} && {' '.join(shlex.quote(x) for x in a)}) &")
missing = len(tus) - len(cmds)
if missing:
    sys.exit(f"ab_variant: {missing} of the TUs are not in {build}/compile_commands.json")
open(work + "/compile.sh", "w").write("\n".join(cmds) + "\nwait\n")
PY
bash "$W/compile.sh"
[ "$(ls "$W"/*.o | wc -l)" -eq $# ] || { echo "ab_variant: a TU failed to compile" >&2; exit 1; }
cp "$B/libgmoe.a" "$W/libgmoe_variant.a"
ar r "$W/libgmoe_variant.a" "$W"/*.o
link=$(cd "$B" && ninja -t commands gmoe-bench | tail -1)
link=${link//libgmoe.a/$W/libgmoe_variant.a}
link=$(echo "$link" | sed -E "s# -o [^ ]*gmoe-bench# -o $W/gmoe-bench#")
(cd "$B" && eval "$link")
mv "$W/gmoe-bench" "$OUTB"
rm -rf "$W"
echo "ab_variant: $OUTB"
