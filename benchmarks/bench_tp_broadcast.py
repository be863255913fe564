"""What sending a step to the tensor-parallel workers costs: the pickled size of a real decode step's
SchedulerOutput, its pickle + unpickle time, and gloo's broadcast_object_list of it between two local
processes (the driver's command group; docs/parallelism.md).

    python -m benchmarks.bench_tp_broadcast --model /path/to/checkpoint --rows 1 64 256 [--repeat 200]
"""

from __future__ import annotations

import argparse
import datetime
import pickle
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def decode_step(model: str, rows: int):
    """The SchedulerOutput of a decode step of `rows` requests, captured from a one-rank CPU engine."""
    from tinyvllm import LLM, SamplingParams

    llm = LLM(model=model, device="cpu", dtype="float32", max_num_seqs=rows)
    steps = []
    launch = llm.llm_engine.runner.launch

    def recording_launch(sched, *args, **kwargs):
        steps.append(sched)
        return launch(sched, *args, **kwargs)

    llm.llm_engine.runner.launch = recording_launch
    prompts = [{"prompt_token_ids": [1 + i % 200, 2, 3]} for i in range(rows)]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    return steps[-1]


def broadcast_times(rank: int, sched, port: int, repeat: int, out) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    times = []
    for _ in range(repeat):
        box = [sched if rank == 0 else None]
        t = time.perf_counter()
        dist.broadcast_object_list(box, src=0)
        times.append(time.perf_counter() - t)
    if rank == 1:
        out.put(sorted(times)[len(times) // 2])
    dist.destroy_process_group()


def main() -> None:
    from tinyvllm.distributed.group import free_port

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    for rows in args.rows:
        sched = decode_step(args.model, rows)
        blob = pickle.dumps(sched)
        t = time.perf_counter()
        for _ in range(args.repeat):
            pickle.loads(pickle.dumps(sched))
        pickling = (time.perf_counter() - t) / args.repeat
        ctx = mp.get_context("spawn")
        out, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=broadcast_times, args=(r, sched, port, args.repeat, out)) for r in range(2)]
        for p in procs:
            p.start()
        median = out.get()
        for p in procs:
            p.join()
        print(
            f"decode step of {rows} rows: {len(blob)} B pickled, pickle+unpickle {pickling * 1e6:.0f} us, "
            f"gloo broadcast_object_list median {median * 1e6:.0f} us"
        )


if __name__ == "__main__":
    main()
