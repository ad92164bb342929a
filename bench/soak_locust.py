"""Locust user for bench/soak.py: Poisson load of greedy completions.

`--arrivals paced` (the default): each user keeps a schedule of its own, a Poisson process of rate `--rate` /
users, and sends each request at its scheduled time (at once, when the one before it ended late), so the users
together send `--rate` requests per second as a Poisson stream whatever the latency, as long as fewer than
`users` are in flight. `--arrivals think`: each user waits an exponentially distributed time (mean users /
rate) after each answer, so the rate falls as latency grows: the load backs off on a server that slows down.
Prompts are random token ids (lengths uniform in [--prompt-min, --prompt-max]), `--max-tokens` greedy tokens
each (ignore_eos). Run by bench/soak.py as its own process (locust patches the standard library with gevent on
import).
"""

from __future__ import annotations

import random
import time

from locust import HttpUser, events, task


@events.init_command_line_parser.add_listener
def _args(parser):
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second, all users together")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-min", type=int, default=16)
    parser.add_argument("--prompt-max", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--model-name", default="soak")
    parser.add_argument("--arrivals", choices=["paced", "think"], default="paced")


class Completions(HttpUser):
    def on_start(self):
        self.next_at = time.monotonic()  # this user's schedule: its first request goes at once

    def wait_time(self):
        o = self.environment.parsed_options
        gap = random.expovariate(o.rate / max(self.environment.runner.user_count, 1))
        if o.arrivals == "think":
            return gap
        self.next_at += gap
        return max(0.0, self.next_at - time.monotonic())

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
