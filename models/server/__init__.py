"""Reward/critic server (NeMo-Aligner's critic server over FastAPI instead of PyTriton), the rollout
server (one long-lived generation engine), and their clients.

| module       | holds                                                                  |
|--------------|------------------------------------------------------------------------|
| `service`    | :class:`RewardCriticService`: infer / train / save on the models, no HTTP |
| `batching`   | :class:`Batcher`: concurrent infer requests → one model batch            |
| `app`        | `create_app`: FastAPI routes, bearer token, size limits (`guarded_app`)   |
| `client`     | :class:`JSONClient` (retries, clear errors), :class:`RewardCriticClient`, :class:`RemoteReward` |
| `schemas`    | request/response bodies shared by app and client                         |
| `paths`      | `check_save_url`: saves stay inside the storage root                     |
| `rollout_service` | :class:`RolloutService`: one engine, weights loaded in place per request |
| `rollout_app` | `create_rollout_app`: ``/generate``, ``/health`` on the same guard         |
| `rollout_client` | :class:`RolloutClient`, :class:`RemoteEngine` (a ``GenerationEngine``)   |
| `rollout_schemas` | request/response bodies of the rollout server                         |
| `__main__`   | `python -m models.server serve ...` / `serve-rollout ...`                |
| `launch`     | :class:`ServerProcess`: the CLI as a child process, waited on until ready |

The package import is light (no torch): import the submodule you need.
"""
