#!/usr/bin/env bash
# The GPU run (CUDA + NCCL through torchrun mode), on a machine with CUDA GPUs and a CUDA build of
# torch. It installs DeepSpeed 0.19.8 and the harness's few pure-Python needs next to the torch it
# finds (never replacing it), then runs `python -m harness gpu`: ZeRO-1/2/3 x offload none/cpu x
# fp32/bf16/fp16, eager and compiled, at world size 1 and every local GPU, against the same oracle;
# the report lands in reports/gpu.html. DeepSpeed's ops JIT-build with the machine's nvcc.
#
#   bash scripts/gpu.sh                      # the machine reaches PyPI
#   bash scripts/gpu.sh --wheels DIR         # offline: install from wheels in DIR (made as below)
#   bash scripts/gpu.sh --fetch-wheels DIR   # on a machine WITH PyPI: fill DIR for a Python 3.12
#                                            # x86-64 GPU machine (pure-Python DeepSpeed wheel + deps)
# Other arguments go to `python -m harness gpu` (--only SUBSTR, --world-sizes 1,8, --no-compiled).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEPS=(hjson ninja psutil pydantic pydantic-core annotated-types typing-inspection typing-extensions msgpack
      einops py-cpuinfo tqdm packaging mpmath matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing
      python-dateutil six numpy)

if [ "${1:-}" = "--fetch-wheels" ]; then
  dir="${2:?--fetch-wheels DIR}"; mkdir -p "$dir"
  # DeepSpeed ships an sdist; with DS_BUILD_OPS=0 it builds a py3-none-any wheel (its ops JIT-build later).
  DS_BUILD_OPS=0 .venv/bin/pip wheel -q --no-deps --no-build-isolation -w "$dir" "deepspeed==0.19.8"
  "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$dir" "${DEPS[@]}"
  echo "gpu.sh: wheels in $dir ($(ls "$dir" | wc -l) files)"; exit 0
fi
WHEELS=""
if [ "${1:-}" = "--wheels" ]; then WHEELS="${2:?--wheels DIR}"; shift 2; fi

"$PY" - <<'PYEOF' || exit 2
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu.sh: torch {torch.__version__} sees no CUDA device; this script is for GPU machines")
print(f"gpu.sh: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x "
      f"{torch.cuda.get_device_name(0)}")
PYEOF

missing=()
"$PY" -c "import deepspeed" 2>/dev/null || missing+=("deepspeed==0.19.8")
for mod in mpmath matplotlib cpuinfo hjson pydantic msgpack einops; do
  "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if ((${#missing[@]})); then
  pkgs=("${missing[@]/cpuinfo/py-cpuinfo}")
  echo "gpu.sh: installing ${pkgs[*]} next to the torch found"
  if [ -n "$WHEELS" ]; then
    # --no-deps over the whole folder: pip must never resolve (and replace) torch.
    "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" "$WHEELS"/*.whl
  else
    "$PY" -m pip install -q "${pkgs[@]}" "torch==$("$PY" -c 'import torch; print(torch.__version__)')"
  fi
fi
"$PY" -c "import deepspeed; assert deepspeed.__version__ == '0.19.8', deepspeed.__version__"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the harness itself, from this checkout
export NVIDIA_TF32_OVERRIDE=0                          # fp32 matmuls in fp32 (harness/cli/gpu.py)
# Budget: the whole run within 8 minutes; the harness's own per-case timeouts stop a hang earlier.
exec timeout 480 "$PY" -m harness gpu "$@"
