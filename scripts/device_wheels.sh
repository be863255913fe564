#!/usr/bin/env bash
# The wheels a device call carries in .whl (git-ignored): what the device image (Python 3.12, torch,
# triton, transformers; no network) lacks for the CLI (msgspec), structured outputs (xgrammar), the
# server (fastapi, uvicorn, prometheus-client, uvloop, httptools) and `bench serve`'s client (aiohttp),
# with their dependencies, resolved for CPython 3.12 on manylinux x86-64. gpu_lib.sh installs them into
# /tmp/site on the device. Run here (network) before a device call: `bash scripts/device_wheels.sh`.
set -eu
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any)
# The server and the client with their dependencies, resolved together (pydantic pins pydantic-core exactly).
python3 -m pip download -q "${target[@]}" -d .whl msgspec fastapi uvicorn prometheus-client uvloop httptools aiohttp
# xgrammar alone: its torch, transformers and triton are the image's.
python3 -m pip download -q "${target[@]}" -d .whl --no-deps xgrammar ninja
ls .whl | wc -l
du -sh .whl
