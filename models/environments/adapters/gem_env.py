"""``gem:ENV_ID``: a GEM environment (``gem-llm``; Liu et al. 2025, "GEM: A Gym for Agentic LLMs")
built by ``gem.make(ENV_ID)``. GEM's environments are Gymnasium-style (``reset(seed) -> observation,
info``; ``step(action) -> observation, reward, terminated, truncated, info``), mapped as
:mod:`.gym_env` maps any such environment: the observation is the next user turn, the assistant's text
the action (the game parses it, e.g. ``\\boxed{7}``), the step's reward this turn's reward, terminated
or truncated the end. Refused here: environments whose data ``gem.make`` downloads from the Hugging Face
hub (``math:*``, ``code:*``, ``qa:*``, ``eval:*``: their ``dataset_name``); its games (``game:*``) and
reasoning-gym tasks (``rg:*``) are made locally."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from models.environments.adapters.gym_env import GymGame, game_class


def import_library() -> None:
    import gem  # noqa: F401


def _spec(env_id: str):
    from gem.envs.registration import ENV_REGISTRY

    if env_id not in ENV_REGISTRY:
        import difflib

        close = difflib.get_close_matches(env_id, list(ENV_REGISTRY), n=3)
        raise ValueError(f"gem has no environment {env_id!r}" + (f" (did you mean {close}?)" if close else ""))
    return ENV_REGISTRY[env_id]


def refuse(env_id: str) -> str:
    """Why ``env_id`` cannot run here (empty: it can)."""
    try:
        spec = _spec(env_id)
    except ValueError as err:
        return str(err)
    name = spec.kwargs.get("dataset_name")
    if name:
        return (f"gem.make({env_id!r}) downloads the dataset {name!r} from the Hugging Face hub, which this "
                f"run does not fetch; put its rows in data.train_prompts and use an environment that takes them")
    return ""


def factory(env_id: str) -> Callable[[Mapping[str, Any]], GymGame]:
    import gem

    _spec(env_id)
    return game_class("GemEnvironment", lambda: gem.make(env_id))
