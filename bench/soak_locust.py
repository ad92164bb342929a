"""Locust user for bench/soak.py: open-loop-like Poisson load of greedy completions.

Each user waits an exponentially distributed time (mean users / rate) between requests, so the users together
send about `--rate` requests per second as a Poisson stream. Prompts are random token ids (lengths uniform in
[--prompt-min, --prompt-max]), `--max-tokens` greedy tokens each (ignore_eos). Run by bench/soak.py as its own
process (locust patches the standard library with gevent on import).
"""

from __future__ import annotations

import random

from locust import HttpUser, events, task


@events.init_command_line_parser.add_listener
def _args(parser):
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second, all users together")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-min", type=int, default=16)
    parser.add_argument("--prompt-max", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--model-name", default="soak")


class Completions(HttpUser):
    def wait_time(self):
        o = self.environment.parsed_options
        return random.expovariate(o.rate / max(self.environment.runner.user_count, 1))

    @task
    def complete(self):
        o = self.environment.parsed_options
        prompt = [random.randrange(1, o.vocab) for _ in range(random.randint(o.prompt_min, o.prompt_max))]
        with self.client.post("/v1/completions", json={"model": o.model_name, "prompt": prompt,
                                                       "max_tokens": o.max_tokens, "temperature": 0,
                                                       "ignore_eos": True},
                              catch_response=True, timeout=120) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
            elif r.json()["usage"]["completion_tokens"] != o.max_tokens:
                r.failure(f"{r.json()['usage']['completion_tokens']} tokens, asked for {o.max_tokens}")
