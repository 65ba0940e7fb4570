"""Chat completions through ``omniloop serve``'s app: N requests one after another vs N at once.

The step scheduler runs the decode steps of every running sequence as one forward, so concurrent
chats share forwards (continuous batching). On a tiny random Qwen2 checkpoint (CPU, float32)::

    OMP_NUM_THREADS=1 python plugins/frontends/server/bench/chat_batching.py [--n 16] [--tokens 64] [--model PATH]

prints tokens/s both ways (greedy; every request makes exactly ``--tokens`` tokens unless EOS).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", help="a Qwen checkpoint folder (default: a tiny random one, built here)")
    args = ap.parse_args()

    from openai import OpenAI

    import omniloop_qwen.plugin as qwen_plugin
    import omniloop_scheduler.plugin as scheduler_plugin
    from omniloop.runtime import Runtime
    from omniloop.testing import make_manager
    from omniloop_server import create_app
    from omniloop_server.testing import serving

    tmp = Path(tempfile.mkdtemp(prefix="chat-bench-"))
    path = args.model
    if path is None:
        from omniloop_qwen.tiny import build_tiny_checkpoint

        path = build_tiny_checkpoint(tmp / "tiny-qwen", arch="qwen2")
    manager = make_manager(("qwen", qwen_plugin), ("scheduler", scheduler_plugin), toy=False, scheduler=False)
    rt = Runtime.from_model(path, manager=manager, device="cpu", dtype="float32", scheduler="step",
                            scheduler_options={"max_batch": args.n, "max_running": args.n})
    app = create_app(rt, output_dir=tmp / "out", shutdown_timeout=0)
    model = app.state.omniloop.model_id
    with serving(app) as url, OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:

        def chat(i: int) -> int:
            out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"hello {i}"}],
                                                 max_tokens=args.tokens, temperature=0)
            assert out.usage is not None
            return out.usage.completion_tokens

        chat(0)  # warm up
        t = time.perf_counter()
        seq_tokens = sum(chat(i) for i in range(args.n))
        seq = time.perf_counter() - t
        counts: list[int] = []
        threads = [threading.Thread(target=lambda i=i: counts.append(chat(i))) for i in range(args.n)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        conc = time.perf_counter() - t
    print(f"one after another: {seq_tokens} tokens in {seq:.2f} s = {seq_tokens / seq:.0f} tokens/s")
    print(f"{args.n} at once:       {sum(counts)} tokens in {conc:.2f} s = {sum(counts) / conc:.0f} tokens/s "
          f"({seq / conc:.2f}x)")


if __name__ == "__main__":
    main()
