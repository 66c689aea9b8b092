"""Reward/critic server (NeMo-Aligner's critic server over FastAPI instead of PyTriton) and its client.

| module       | holds                                                                  |
|--------------|------------------------------------------------------------------------|
| `service`    | :class:`RewardCriticService`: infer / train / save on the models, no HTTP |
| `batching`   | :class:`Batcher`: concurrent infer requests → one model batch            |
| `app`        | `create_app`: FastAPI routes, bearer token, size limits                  |
| `client`     | :class:`RewardCriticClient` (retries, clear errors), :class:`RemoteReward` |
| `schemas`    | request/response bodies shared by app and client                         |
| `paths`      | `check_save_url`: saves stay inside the storage root                     |
| `__main__`   | `python -m models.server serve ...`                                      |
| `launch`     | :class:`ServerProcess`: the CLI as a child process, waited on until ready |

The package import is light (no torch): import the submodule you need.
"""
