#!/usr/bin/env bash
# The wheels a device call carries in .whl (git-ignored): what the device image (Python 3.12, torch,
# triton, transformers; no network) lacks for the CLI (msgspec), structured outputs (xgrammar), the
# server (fastapi, uvicorn, prometheus-client, uvloop, httptools) and `bench serve`'s client (aiohttp),
# with their dependencies, resolved for CPython 3.12 on manylinux x86-64. gpu_lib.sh installs them into
# /tmp/site on the device. Run here (network) before a device call: `bash scripts/device_wheels.sh`.
set -eu
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d .whl --no-deps \
  msgspec fastapi starlette pydantic pydantic-core typing-inspection annotated-types anyio sniffio idna \
  uvicorn h11 click prometheus-client uvloop httptools aiohttp aiohappyeyeballs aiosignal attrs frozenlist \
  multidict propcache yarl xgrammar ninja typing-extensions
ls .whl | wc -l
du -sh .whl
