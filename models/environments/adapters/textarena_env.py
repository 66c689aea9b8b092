"""``textarena:ENV_ID``: a single-player TextArena game (``textarena``; Guertler et al. 2025,
"TextArena") built by ``textarena.make``. The game is made without TextArena's default wrappers (its
``-raw`` variant where registered): those re-send the whole history in every observation, where here
the chat template carries the history and each turn shows only what is new.

- first user turn: the game's prompt (``get_observation()`` after ``reset(num_players=1, seed)``);
- action: the assistant's text, parsed by the game (e.g. ``[7]`` in GuessTheNumber);
- next user turn: the observations the game added since (``[GAME] The target number is higher.``);
- reward: TextArena gives one at the game's end (``close()``'s reward of player 0), 0 before;
  an episode cut by ``rollout.max_turns`` first ends truncated with reward 0;
- done: ``step()``'s ``done``.

Games for two players or more are refused (self-play is not adapted), as are games whose data is not
on this machine (e.g. NLTK corpora): the set-up starts one game per probe row and reports the error."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Tuple

from models.environments.adapters.text_turns import TextGame, seeded


def import_library() -> None:
    import textarena  # noqa: F401


def _registered(env_id: str) -> str:
    """The id to make: ``ENV_ID-raw`` (no wrappers) where TextArena registers one."""
    from textarena.envs.registration import ENV_REGISTRY

    if env_id not in ENV_REGISTRY:
        import difflib

        close = difflib.get_close_matches(env_id, list(ENV_REGISTRY), n=3)
        raise ValueError(f"textarena has no environment {env_id!r}" + (f" (did you mean {close}?)" if close else ""))
    raw = f"{env_id}-raw"
    return raw if raw in ENV_REGISTRY and not env_id.endswith("-raw") else env_id


def refuse(env_id: str) -> str:
    try:
        _registered(env_id)
    except ValueError as err:
        return str(err)
    return ""


def render(observations) -> str:
    """TextArena's ``(sender, message, type)`` observations as one user turn: each message on its own line,
    the game's prefixed ``[GAME]`` (the player's own echoed actions left out)."""
    import textarena as ta

    lines = []
    for sender, message, kind in observations or ():
        if kind == ta.ObservationType.PLAYER_ACTION:
            continue
        lines.append(f"[GAME] {message}" if sender == ta.GAME_ID and kind != ta.ObservationType.PROMPT else str(message))
    return "\n".join(lines)


class TextArenaGame(TextGame):
    env_id = ""

    def reset(self) -> Any:
        import textarena as ta

        self.env = ta.make(_registered(self.env_id))
        try:
            seeded(self.seed, lambda: self.env.reset(num_players=1, seed=self.seed))
        except AssertionError as err:
            raise ValueError(f"textarena {self.env_id!r} is not a single-player game ({err}): only single-player "
                             f"games are adapted") from None
        return render(self.env.get_observation()[1])

    def act(self, action: str) -> Tuple[Any, float, bool]:
        done, _ = self.env.step(action)
        if not done:
            return render(self.env.get_observation()[1]), 0.0, False
        rewards, _ = self.env.close()
        return "", float((rewards or {}).get(0, 0.0)), True


def factory(env_id: str) -> Callable[[Mapping[str, Any]], TextArenaGame]:
    _registered(env_id)
    return type("TextArenaEnvironment", (TextArenaGame,), {"env_id": env_id})
