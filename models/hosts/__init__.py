"""The hosts: what a service holds (its models) and the ops it serves on the service layer (``models/service/``),
each op a stage function of ``models/stages/`` called whole with the host's models.

| module          | holds                                                                                    |
|-----------------|------------------------------------------------------------------------------------------|
| `engine`        | `EngineHost`: a resident run's generation engine; rollout, evaluate, the actor's new weights |
| `producer`      | `Producer`: the engine's background sampler and buffer of an asynchronous run (max_staleness ≥ 2) |
| `async_batch`   | the batch an asynchronous run's rollout takes from that buffer, with its ``async/*`` metrics |
| `trainers`      | `ActorHost`, `CriticHost`: a resident run's trainers on every rank; score, values, update    |
| `colocated`     | `ColocatedActorHost`: the actor whose ranks also generate (``run.resident_layout=colocated``) |
| `transports`    | the actor's weights to the engine: one interface, its HTTP, collective and LoRA adapter ends |
| `resident`      | a resident run's services: one's life in its process, their local start and stop (torch-free) |
| `reward_critic` | `RewardCriticHost`: the reward/critic server someone starts (``critic.remote_url``)         |
| `rollout`       | `RolloutHost`: the rollout server someone starts (``rollout.remote_url``)                    |
| `ranks`         | a local resident trainer service's ranks, forked from one process that imported them       |
| `__main__`      | ``python -m models.hosts serve | serve-rollout | engine | actor | critic | ranks``         |

The package import is light (no torch): import the module you need.
"""
