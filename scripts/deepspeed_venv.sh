#!/usr/bin/env bash
# Set up (idempotently) a venv for another DeepSpeed and print its path on the last line.
#   bash scripts/deepspeed_venv.sh 0.19.7          a release from PyPI (its sdist; ops JIT-built once, below)
#   bash scripts/deepspeed_venv.sh /path/to/DeepSpeed   a source checkout, installed editable
# The venv lives outside the checkout (MUON_HARNESS_VENVS, default ~/.cache/muon-zero-harness/venvs), with
# torch==2.13.0 and the harness's own dependencies, but never the pinned deepspeed==0.19.8. Its ops are
# built once into the op cache keyed by torch and that DeepSpeed's version (harness/env/buildenv.py).
set -euo pipefail
cd "$(dirname "$0")/.."
spec="${1:?usage: deepspeed_venv.sh VERSION|PATH}"
root="${MUON_HARNESS_VENVS:-${MUON_HARNESS_CACHE:-$HOME/.cache/muon-zero-harness}/venvs}"
if [ -d "$spec" ]; then
  spec="$(cd "$spec" && pwd)"
  [ -f "$spec/setup.py" ] && [ -d "$spec/deepspeed" ] || { echo "--deepspeed $spec: not a DeepSpeed source checkout (no setup.py + deepspeed/)" >&2; exit 2; }
  name="src-$(echo "$spec" | sha1sum | cut -c1-10)"
elif [[ "$spec" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  name="$spec"
else
  echo "--deepspeed $spec: give a release (e.g. 0.19.7) or the path of a DeepSpeed source checkout" >&2; exit 2
fi
venv="$root/ds-$name"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
mkdir -p "$root"
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
stamp="$venv/.installed-$(cat pyproject.toml "$0" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  pip=("$venv/bin/pip" install -q --disable-pip-version-check)
  "${pip[@]}" "torch==2.13.0"
  # The harness's dependencies from pyproject.toml, with the [models] extra (the model cases: the same
  # cases on every tree, as compare needs), less the pinned DeepSpeed (this venv gets another).
  mapfile -t deps < <("$venv/bin/python" - <<'PYDEPS'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = project["dependencies"] + project.get("optional-dependencies", {}).get("models", [])
print("\n".join(d for d in deps if not d.startswith(("deepspeed", "torch"))))
PYDEPS
)
  # DeepSpeed's own runtime requirements (its sdist is installed without deps so pip cannot swap torch)
  "${pip[@]}" "${deps[@]}" hjson msgpack ninja packaging psutil pydantic tqdm einops py-cpuinfo
  if [ -d "$spec" ]; then
    DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation --no-deps -e "$spec"
  else
    DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation --no-deps --no-binary deepspeed "deepspeed==$spec"
  fi
  touch "$stamp"
fi
echo "$venv"
