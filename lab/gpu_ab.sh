#!/usr/bin/env bash
# A/B of whole revisions on the H200, each run in its own fresh process, revisions alternating round by round.
#
# Here (a git checkout):   bash lab/gpu_ab.sh prepare main some-branch [more revisions ...]
#   writes each revision's tree (git archive) to scratch/ab/<name> (untracked: it travels with the working tree).
# On the device (repo root, .whl carried; OUT set):
#                          bash lab/gpu_ab.sh run qwen3.6-35b-a3b 3 [TESTS ...]
#   installs the carried wheels, runs `lab/gpu_quick.py` of every prepared tree (each revision needs its own) for
#   the preset, ROUNDS times in alternating order, then the GPU tests TESTS (pytest paths) in every tree but the
#   first (the base), prints a table of graphs ms and overlapped ms per revision and round, and leaves everything
#   in $OUT/ab.tgz (the device tool returns at most 8 files).
set -uo pipefail
AB=scratch/ab
case "${1:-}" in
prepare)
  shift
  rm -rf "$AB" && mkdir -p "$AB"
  for rev in "$@"; do
    name=$(echo "$rev" | tr '/' '_')
    mkdir -p "$AB/$name" && git archive "$rev" | tar -x -C "$AB/$name" || exit 1
    echo "$name" >> "$AB/order"
    echo "$AB/$name <- $(git rev-parse --short "$rev")"
  done
  ;;
run)
  preset=$2 rounds=$3
  shift 3
  OUT=${OUT:?set OUT}
  mkdir -p "$OUT/ab"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONUNBUFFERED=1
  trees=$(cat "$AB/order")
  for round in $(seq "$rounds"); do
    for name in $trees; do
      log="$OUT/ab/${name}_$round"
      (cd "$AB/$name" && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 lab/gpu_quick.py "$log" "$preset") \
        > "$log.log" 2>&1
      echo "== $name round $round: exit $?"; tail -n 1 "$log.log"
    done
  done
  for name in $(echo "$trees" | tail -n +2); do  # the candidates' GPU tests (the first revision is the base)
    [ $# -gt 0 ] || break
    (cd "$AB/$name" && PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu "$@") \
      > "$OUT/ab/tests_$name.log" 2>&1
    echo "== GPU tests in $name: exit $?"; tail -n 3 "$OUT/ab/tests_$name.log"
  done
  python3 - "$OUT/ab" <<'PY'
import glob, json, sys
print("| revision_round | copy GB/s | graphs ms | overlapped ms | overlapped tok/s (of roofline) |")
for path in sorted(glob.glob(f"{sys.argv[1]}/*/quick_*.json")):
    run = json.load(open(path))
    ahead = run["decode_1_overlapped"]
    print(f"| {path.split('/')[-2]} | {run['copy_bandwidth_gb_s']:.0f} | {run['decode_1']['replay_ms']:.3f} | "
          f"{ahead['step_ms']:.3f} | {ahead['tok_s']:.1f} ({ahead['of_roofline']:.1%}) |")
PY
  tar czf /tmp/ab.tgz -C "$OUT" ab && rm -rf "$OUT/ab" && mv /tmp/ab.tgz "$OUT/"
  ;;
*)
  echo "usage: $0 prepare REV [REV ...] | run PRESET ROUNDS [TESTS ...]" >&2
  exit 2
  ;;
esac
