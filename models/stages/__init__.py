"""One plain function per stage of a training iteration, Flyte-free: the Flyte tasks of ``tasks/`` are
their adapters, and a long-lived service can call the same functions.

| stage | function | returns |
|---|---|---|
| rollout | :func:`models.stages.rollout.run_rollout` (an asynchronous run's engine: :func:`models.hosts.async_batch.take_rollout`, metrics in :mod:`models.stages.async_metrics`) | :class:`~models.stages.outputs.RolloutOutput` |
| score | :func:`models.stages.score.run_score` | :class:`~models.stages.outputs.ScoreOutput` |
| advantages | :func:`models.stages.advantages.run_advantages` | :class:`~models.stages.outputs.AdvantagesOutput` |
| actor update | :func:`models.stages.actor.train_actor` (one rank), :func:`~models.stages.actor.train_actor_ranks` (every rank of a launch) | :class:`~models.stages.outputs.UpdateOutput` |
| critic update | :func:`models.stages.critic.train_critic` (one rank), :func:`~models.stages.critic.train_critic_ranks` (every rank of a launch) | :class:`~models.stages.outputs.UpdateOutput` |
| commit | :func:`models.stages.commit.run_commit` | the next :class:`~models.run.types.PolicyState` |
| evaluate | :func:`models.stages.evaluate.run_evaluate` | the held-out mean reward |
| finish | :func:`models.stages.finish.run_finish` | :class:`~models.stages.outputs.TrainingSummary` |

A run's launch is :func:`models.stages.prepare.prepare` (``models/run/setup.py`` lays the run out);
scheduled retraining's plan and decision are in :mod:`models.stages.retrain`; which service a stage calls (a
resident run's own, or a server at ``*.remote_url``) is :mod:`models.stages.services`. Each stage takes the
typed config (:mod:`models.config`), the run (:class:`~models.run.types.RunHandle`), the policy state
(:class:`~models.run.types.PolicyState`) and a batch (:class:`~models.data.batch.RolloutBatch`) as it
needs. Importing this package (or any of its modules) loads no flytekit.
"""
