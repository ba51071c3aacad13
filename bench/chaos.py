"""The operator's chaos run: two gateway replicas, 2 prefill + 2 decode nodes, streaming
clients and a fault every --fault-every seconds for --duration seconds (kill -9 and SIGSTOP
of every role in turn; tests/faults/chaos.py says what counts).

    python bench/chaos.py [--duration 600] [--fault-every 25] [--clients 6]
                          [--prompts 24] [--max-new-tokens 48]

Targets (issue 35): 0 different outputs, 0 errors from node faults (only streams through a
killed or stopped gateway replica may drop), 0 hung requests, 0 pages held at the end.
Prints the faults as they come, a table and one JSON line {"bench": "chaos", ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_info import describe_cpu  # noqa: E402

from tests.faults.chaos import ChaosCluster, run_chaos  # noqa: E402
from tests.support import parity  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--fault-every", type=float, default=25.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    print(f"CPU: {describe_cpu()}")
    prompts = parity.load_prompts(args.prompts)
    refs = parity.references(prompts, args.max_new_tokens)
    cluster = ChaosCluster(prefill_args=["--chunked-prefill-size", "64"]).start()
    started = time.monotonic()
    try:
        report = run_chaos(
            cluster,
            prompts,
            refs,
            duration_s=args.duration,
            fault_every_s=args.fault_every,
            num_clients=args.clients,
            max_new_tokens=args.max_new_tokens,
        )
    finally:
        cluster.close()
    summary = report.summary()
    print(f"\nchaos run: {time.monotonic() - started:.0f} s\n")
    print("| measure | value |\n|---|---|")
    for key, value in summary.items():
        print(f"| {key} | {value} |")
    for line in report.different[:5] + report.node_fault_errors[:10] + report.hung[:5]:
        print(f"  {line}")
    print(json.dumps({"bench": "chaos", "duration_s": args.duration, **summary}))


if __name__ == "__main__":
    main()
