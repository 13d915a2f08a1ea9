#!/usr/bin/env bash
# Download, into .whl/, the wheels hetjax needs that a GPU image with jax, flax, optax, orbax,
# torch and transformers lacks (Python 3.12, x86-64), so that scripts/tools/gpu_check.sh can
# install them there without a network. Run once:
#     bash scripts/tools/gpu_wheels.sh
set -euo pipefail
case "${1:-}" in
  -h|--help) echo "usage: bash scripts/tools/gpu_wheels.sh"
             sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
esac
cd "$(dirname "$0")/../.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pins=(ml-collections==1.1.0 grain==0.2.18 array-record==0.8.6 portpicker tensorboardX==2.6.5
      tensorflow-datasets==4.9.10 dm-tree immutabledict simple-parsing docstring-parser
      tensorflow-metadata googleapis-common-protos termcolor toml)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .whl "${pins[@]}"
# promise ships only a source distribution: build its pure-Python wheel here
python3 -m pip wheel -q --no-deps -w .whl promise==2.3
ls .whl
