"""`python -m bench.router_prefix_bench [--systems 4] [--questions 6] [--clients 4]
[--policies cache_aware,round_robin] [--repeats 3] [--out FILE]`: the fleet's prefix hit ratio
behind sglang-router, with requests in flight together (issue 30's router target: >= 95% of an
ideal cache's under cache_aware).

Per policy, a fresh fleet of two replicas (tiny random Llama, `--threads 1`; the fleet of
tests/deploy/test_router_replicas.py, with room for every system prompt on each replica) gets,
`--repeats` times with fresh system prompts, `--systems` system prompts of about
`--system-tokens` tokens x `--questions` questions, interleaved (every system's first question,
then every system's second, ...), sent by `--clients` concurrent clients in that order.
The fleet's hits are the replicas' `cellserve_prefix_cache_hit_tokens` increase; the ideal is
one cache that holds every earlier prompt (`ideal_hits` over the rendered token ids, as the
test computes it). Each request's `cached_tokens` against its own ideal names the requests that
missed, with how many requests of the same system were in flight when it was sent.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx

from tests.deploy.test_router_replicas import _counter, ideal_hits, sglang_fleet

REPLICA_FLAGS = ["--threads", "1", "--n-cells", "8192", "--ctx-per-seq", "1024", "--n-seq-max", "8"]
SENTENCES = [
    "Keep answers short and plain.",
    "Cite the shelf and the row when you can.",
    "Ask one question back if the request is vague.",
    "Never invent a title that is not in the catalogue.",
    "Prefer recent editions over old ones.",
    "Say so when a book is on loan.",
]


@dataclass
class Sent:
    system: int
    question: int
    start: float
    end: float
    status: int
    cached: int
    prompt_tokens: int


def system_prompt(desk: str, num_tokens: int) -> str:
    """About num_tokens tokens of the tiny tokenizer (~2.4 characters a token)."""
    text, k = f"You are {desk}.", 0
    while len(text) < num_tokens * 2.4:
        text += f" {k}. {SENTENCES[k % len(SENTENCES)]}"
        k += 1
    return text


def chat(client: httpx.Client, router: str, system: str, question: str, max_tokens: int) -> dict:
    """One model-less chat request through the router: its status and, on 200, its body."""
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    resp = client.post(f"{router}/v1/chat/completions", json=body, timeout=120)
    return {"status": resp.status_code, **(resp.json() if resp.status_code == 200 else {})}


def run_round(fleet, args: argparse.Namespace, tag: str) -> dict:
    urls = [r.url for r in fleet.replicas]
    systems = [system_prompt(f"desk {tag}-{k}", args.system_tokens) for k in range(args.systems)]
    workload = [(s, q) for q in range(args.questions) for s in range(args.systems)]
    texts = [(systems[s], f"Question {q} from desk {tag}?") for s, q in workload]
    in_flight: dict[int, int] = {s: 0 for s in range(args.systems)}
    busy_at_send: list[int] = [0] * len(workload)
    lock = threading.Lock()
    before = {u: _counter(u, "cellserve_prefix_cache_hit_tokens") for u in urls}
    client = httpx.Client()

    def send(i: int) -> Sent:
        s, q = workload[i]
        with lock:
            busy_at_send[i] = in_flight[s]
            in_flight[s] += 1
        t0 = time.monotonic()
        out = chat(client, fleet.router, *texts[i], args.max_tokens)
        t1 = time.monotonic()
        with lock:
            in_flight[s] -= 1
        usage = out.get("usage", {})
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return Sent(s, q, t0, t1, out["status"], cached, usage.get("prompt_tokens", 0))

    with ThreadPoolExecutor(args.clients) as pool:
        sent = list(pool.map(send, range(len(workload))))
    client.close()
    per_replica = [_counter(u, "cellserve_prefix_cache_hit_tokens") - before[u] for u in urls]
    prompts = []
    for system, question in texts:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        rendered = httpx.post(f"{urls[0]}/v1/chat/completions/render", json={"messages": messages})
        prompts.append(rendered.json()["token_ids"])
    ideal = ideal_hits(prompts)
    misses = [
        {"i": i, **asdict(x), "ideal": ideal[i], "same_system_in_flight": busy_at_send[i]}
        for i, x in enumerate(sent)
        if x.cached < ideal[i]
    ]
    hit = sum(per_replica)
    return {
        "prompt_tokens": [len(p) for p in prompts[: args.systems]],
        "failed": sum(x.status != 200 for x in sent),
        "hit": hit,
        "hit_per_replica": per_replica,
        "cached_tokens_sum": sum(x.cached for x in sent),
        "ideal": sum(ideal),
        "ratio": hit / sum(ideal),
        "misses": misses,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--policies", default="cache_aware,round_robin")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write every round's result here as JSON")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {}
    for policy in args.policies.split(","):
        with sglang_fleet(policy=policy, replica_flags=REPLICA_FLAGS) as fleet:
            results[policy] = [run_round(fleet, args, f"{policy}{r}") for r in range(args.repeats)]
        for r, res in enumerate(results[policy]):
            print(
                f"{policy} round {r}: fleet hits {res['hit']:.0f} "
                f"(per replica {[round(h) for h in res['hit_per_replica']]}), ideal {res['ideal']}"
                f" -> {res['ratio']:.1%}; failed {res['failed']}; {len(res['misses'])} requests "
                f"below their ideal; system prompts {res['prompt_tokens']} tokens"
            )
            for m in res["misses"]:
                print(
                    f"  miss #{m['i']} system {m['system']} q{m['question']}: cached "
                    f"{m['cached']} of ideal {m['ideal']}, same system in flight at send "
                    f"{m['same_system_in_flight']}"
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
