"""The service layer: what keeps a model loaded behind an address, for a run's own services (``run.resident``)
and for the servers someone else starts (``critic.remote_url``, ``rollout.remote_url``, ``reward.remote_url``).
Torch-free; the hosts that hold the models sit above the stages (``models/hosts/``).

| module   | holds                                                                                       |
|----------|---------------------------------------------------------------------------------------------|
| `ops`    | `@op` and `Host`: a host class's ops; what a request must pass (op, arguments, locations, digest) |
| `server` | `Server`: the one HTTP server (token guard, limits, heartbeats), serial on every rank or concurrent |
| `ranks`  | `RankFanout`: a trainer's requests on every rank, each op's outcome agreed before rank 0 answers |
| `token`  | the bearer token of a run's services, derived from a secret, never stored                    |
| `client` | `ServiceClient`: the one retrying client, errors naming the service                        |
| `book`   | the address book of a run's services, in its folder, by launch                              |
| `launch` | `serve`: a service's life in its process; `ChildProcess`: one started from this process    |

Adding an op: a method marked `@op` on its host class (``models/hosts/``), called as
``client.call(name, args)``; adding a weight transport: ``models/hosts/transports.py``.
"""
