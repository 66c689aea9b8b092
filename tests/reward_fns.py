"""Reward functions the tests name by spec (``tests.reward_fns:...``), in a module as light as a
user's own: a worker process imports it quickly."""

from __future__ import annotations

import math
import time


def reward_zero(prompts, responses):
    return [0.0] * len(prompts)


def reward_raises(prompts, responses):
    raise KeyError("answer")


def reward_wrong_length(prompts, responses):
    return [0.0]


def reward_nan(prompts, responses):
    return [math.nan] * len(prompts)


def reward_inf(prompts, responses):
    return [0.0] * (len(prompts) - 1) + [math.inf]


def reward_string(prompts, responses):
    return "0.5"


def reward_hangs(prompts, responses):
    while True:
        time.sleep(1)


def answer_length(prompts, responses, answer):
    """The length of the row's ``answer`` column: shows the column reached the function."""
    return [float(len(str(a))) for a in answer]


def wants_missing_column(prompts, responses, solution):
    return [0.0] * len(prompts)


def hang_unless_empty(prompts, responses):
    """Passes the set-up check (empty responses), never returns on real ones."""
    while any(responses):
        time.sleep(1)
    return [0.0] * len(prompts)


def one_argument(responses):
    """Fits neither form: not two positional parameters, no ``completions``, no ``**kwargs``."""
    return [0.0] * len(responses)
