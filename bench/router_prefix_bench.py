"""`python -m bench.router_prefix_bench [--systems 3] [--questions 8] [--clients 4]
[--policies cache_aware,round_robin] [--repeats 3] [--out FILE]`: the fleet's prefix hit ratio
behind sglang-router, with requests in flight together (the target: >= 95% of an
ideal cache's under cache_aware).

Per policy, a fresh fleet of two replicas (tiny random Llama, `--threads 1`; the fleet of
tests/deploy/test_router_replicas.py, with room for every system prompt on each replica) gets,
`--repeats` times with fresh system prompts, `--systems` system prompts of `--system-tokens`
tokens (rendered, template included) x `--questions` questions, interleaved (every system's
first question, then every system's second, ...), sent by `--clients` concurrent clients in
that order: with more clients than systems, requests of one system are in flight together.
An even number of systems over two replicas would make round-robin sticky by accident.
The fleet's hits are the replicas' `cellserve_prefix_cache_hit_tokens` increase; the ideal is
one cache that holds every earlier prompt (`ideal_hits` over the rendered token ids, as the
test computes it). Each request whose `cached_tokens` differs from its own ideal is listed,
with how many requests of the same system were in flight when it was sent (the ideal follows
the send order; clients may reach the router in another, so one request of a system can fall
short of its ideal while another passes it, the system's total unchanged).
NOTE: a round's ideal counts only that round's earlier prompts; its first prompts also share
the chat template's start with earlier rounds' on the replicas, so a ratio can pass 100%.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx

try:  # the fleet is the deploy tests' (tiny random model, replicas, router): a checkout's
    from tests.deploy.test_router_replicas import _counter, ideal_hits, sglang_fleet
except ImportError as e:  # an installed copy ships bench/ without tests/
    raise SystemExit(
        "bench.router_prefix_bench runs from a cellserve checkout (it builds the fleet of "
        f"tests/deploy/test_router_replicas.py): {e}"
    ) from e

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


def system_prompt(url: str, desk: str, num_tokens: int) -> str:
    """A system prompt whose rendered message is at least num_tokens tokens long."""
    text, k = f"You are {desk}.", 0
    while len(render(url, [{"role": "system", "content": text}])) < num_tokens:
        text += f" {k}. {SENTENCES[k % len(SENTENCES)]}"
        k += 1
    return text


def render(url: str, messages: list[dict]) -> list[int]:
    resp = httpx.post(f"{url}/v1/chat/completions/render", json={"messages": messages}, timeout=30)
    return resp.json()["token_ids"]


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
    systems = [
        system_prompt(urls[0], f"desk {tag}-{k}", args.system_tokens) for k in range(args.systems)
    ]
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
    prompts = [
        render(urls[0], [{"role": "system", "content": s}, {"role": "user", "content": q}])
        for s, q in texts
    ]
    ideal = ideal_hits(prompts)
    requests = [
        {"i": i, **asdict(x), "ideal": ideal[i], "same_system_in_flight": busy_at_send[i]}
        for i, x in enumerate(sent)
    ]
    hit = sum(per_replica)
    return {
        "prompt_tokens": [len(p) for p in prompts[: args.systems]],  # first question's
        "failed": sum(x.status != 200 for x in sent),
        "hit": hit,
        "hit_per_replica": per_replica,
        "cached_tokens_sum": sum(x.cached for x in sent),
        "ideal": sum(ideal),
        "ratio": hit / sum(ideal),
        "requests": requests,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", type=int, default=3)  # odd: round-robin splits each system
    ap.add_argument("--questions", type=int, default=8)
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
                f" -> {res['ratio']:.1%}; failed {res['failed']}; first prompts "
                f"{res['prompt_tokens']} tokens; sent with the same system in flight "
                f"{sum(m['same_system_in_flight'] > 0 for m in res['requests'])}"
            )
            for m in res["requests"]:
                if m["cached"] != m["ideal"]:
                    print(
                        f"  #{m['i']} system {m['system']} q{m['question']}: cached "
                        f"{m['cached']}, ideal {m['ideal']}, same system in flight at send "
                        f"{m['same_system_in_flight']}"
                    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
