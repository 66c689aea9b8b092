"""``gym:module:factory``: any Gymnasium-style text environment, ``factory()`` returning an object with
``reset(seed=...) -> (observation, info)`` and ``step(action) -> (observation, reward, terminated,
truncated, info)`` (the older ``(observation, reward, done, info)`` too). No library needed: gem's
games, a Gymnasium ``Env`` with text spaces, or a class of one's own fit. Mapping (:mod:`.text_turns`):
the observation is the next user turn, the assistant's text the action, the step's reward this
turn's reward, terminated or truncated the episode's end."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Tuple

from models.environments.adapters.text_turns import TextGame, seeded


def import_library() -> None:
    """Nothing to import: the factory's module is the user's."""


def step_outcome(result: Tuple) -> Tuple[Any, float, bool]:
    """``(observation, reward, over)`` of a Gymnasium 5-tuple or an old-gym 4-tuple."""
    if len(result) == 5:
        obs, reward, terminated, truncated, _ = result
        return obs, float(reward or 0.0), bool(terminated or truncated)
    if len(result) == 4:
        obs, reward, done, _ = result
        return obs, float(reward or 0.0), bool(done)
    raise TypeError(f"step() returned {len(result)} values; a Gymnasium-style environment returns "
                    f"(observation, reward, terminated, truncated, info)")


def reset_observation(result: Any) -> Any:
    """The observation of ``reset()``'s ``(observation, info)`` (or a bare observation)."""
    return result[0] if isinstance(result, tuple) and len(result) == 2 else result


class GymGame(TextGame):
    """One environment ``make()`` builds, reset with the row's seed."""

    make: Callable[[], Any] = staticmethod(lambda: None)

    def reset(self) -> Any:
        self.env = type(self).make()
        return reset_observation(seeded(self.seed, lambda: self.env.reset(seed=self.seed)))

    def act(self, action: str) -> Tuple[Any, float, bool]:
        return step_outcome(self.env.step(action))

    def close(self) -> None:
        getattr(getattr(self, "env", None), "close", lambda: None)()


def game_class(name: str, make: Callable[[], Any]) -> type:
    """A :class:`GymGame` subclass whose environments ``make`` builds."""
    return type(name, (GymGame,), {"make": staticmethod(make)})


def factory(rest: str) -> Callable[[Mapping[str, Any]], GymGame]:
    from models.environments.adapters import import_object

    return game_class("GymEnvironment", import_object(rest, "rollout.environment=gym:..."))
