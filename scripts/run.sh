#!/usr/bin/env bash
# The project's only entry point for set-up. Idempotent: every step checks before it works.
#   bash scripts/run.sh main   install everything, then run the gate (CI subset; --full for all) and write reports/gate.html
#   bash scripts/run.sh test   install everything, then run the test suite (what .ci/run does)
#   bash scripts/run.sh mutation [--sample N --seed S]   source mutation of DeepSpeed's Muon code
#   bash scripts/run.sh compare --base A --head B [args]   judge a DeepSpeed change (docs/compare.md)
# Extra arguments after the subcommand go to the harness CLI (main) or to pytest (test).
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-}"; shift || true
# --deepspeed VERSION|PATH (anywhere after the subcommand): run against another DeepSpeed in its own venv
ds_other=""; rest=()
while (($#)); do
  if [ "$1" = "--deepspeed" ]; then ds_other="${2:?--deepspeed needs a release or a source checkout path}"; shift 2
  else rest+=("$1"); shift; fi
done
set -- "${rest[@]+"${rest[@]}"}"

need_apt=()
dpkg -s libaio-dev >/dev/null 2>&1 || need_apt+=(libaio-dev)      # DeepSpeed's async_io op (NVMe offload)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)        # the report's browser test
if ((${#need_apt[@]})); then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  # torch pinned exactly: torch==2.13.0 resolves to the CPU wheel, where a range would pull a CUDA build.
  echo "setup: installing torch 2.13.0 (CPU) and the harness's dependencies into .venv ($(date -u +%T))"
  .venv/bin/pip install --progress-bar off --disable-pip-version-check "torch==2.13.0"
  # [models]: transformers for the GPT-2 / Llama model cases (without it they are deselected, saying so)
  .venv/bin/pip install --progress-bar off --disable-pip-version-check -e ".[models,mutation]"
  echo "setup: .venv ready ($(date -u +%T))"
  touch "$stamp"
fi
# Cosmic Ray (source mutation, harness/selfcheck/source_mutation) in a venv of its own: the harness runs its
# cosmic-ray executable; nothing of it is imported by the harness or the ranks.
# Installed beside the warm-up (pip waits on the network and the disk, the warm-up on the cores), its
# output in .venv-mutation/install.log, shown only if it fails.
mut_pid=""
trap '[ -z "$mut_pid" ] || kill "$mut_pid" 2>/dev/null || true' EXIT
if [ ! -f .venv-mutation/.installed-cosmic-ray-8.7.0 ]; then
  "$PY" -m venv .venv-mutation
  echo "setup: installing cosmic-ray 8.7.0 into .venv-mutation beside the warm-up ($(date -u +%T))"
  .venv-mutation/bin/pip install --progress-bar off --disable-pip-version-check "cosmic-ray==8.7.0" \
    > .venv-mutation/install.log 2>&1 &
  mut_pid=$!
fi
mutation_ready() {  # wait for the install started above, if any; its log and exit 1 if it failed
  [ -n "$mut_pid" ] || return 0
  if wait "$mut_pid"; then
    mut_pid=""; touch .venv-mutation/.installed-cosmic-ray-8.7.0
    echo "setup: cosmic-ray 8.7.0 ready ($(date -u +%T))"
  else
    mut_pid=""; tail -n 30 .venv-mutation/install.log >&2
    echo "setup: installing cosmic-ray failed (the whole log: .venv-mutation/install.log)" >&2; exit 1
  fi
}

if [ -n "$ds_other" ]; then
  # Another DeepSpeed: its own venv, its ops built once, the stock column only where the patched runtime
  # does not apply (harness/env/versions.py), no mutation self-check (the mutants patch 0.19.8's functions).
  venv="$(bash scripts/deepspeed_venv.sh "$ds_other" | tail -1)"
  "$venv/bin/python" -m harness.launch.warmup --skip-compile
  mutation_ready
  tag="$("$venv/bin/python" -c 'from harness.env import versions; print(versions.installed().version.replace("+", "-"))')"
  case "$what" in
    main) exec "$venv/bin/python" -m harness gate --no-mutate --report "reports/gate-$tag.html" "$@" ;;
    test) exec "$venv/bin/python" -m pytest "$@" ;;
    *) echo "usage: bash scripts/run.sh main|test --deepspeed VERSION|PATH [args]" >&2; exit 2 ;;
  esac
fi

# Op builds and the torch.compile cache, once, outside any test timeout.
.venv/bin/python -m harness.launch.warmup
mutation_ready

case "$what" in
  main)
    # Two local shards side by side (harness/launch/jobs.py) unless the caller splits the gate itself.
    jobs=(--jobs 2); for a in "$@"; do case "$a" in --shard*|--jobs*) jobs=() ;; esac; done
    exec .venv/bin/python -m harness gate --report reports/gate.html "${jobs[@]}" "$@" ;;
  test)
    .venv/bin/ruff check .   # lint first (under a second); a finding fails the run
    exec .venv/bin/python -m pytest -n 2 "$@" ;;
  report) exec .venv/bin/python -m harness report "$@" ;;  # merge shards' results (docs/sharding.md)
  mutation) exec .venv/bin/python -m harness mutate --engine cosmic-ray "$@" ;;  # docs/mutation.md
  compare) exec .venv/bin/python -m harness compare "$@" ;;  # each side's venv is set up by the command
  *) echo "usage: bash scripts/run.sh main|test|report|mutation|compare [args]" >&2; exit 2 ;;
esac
