"""The trainer's side of the model: forwards (``policy.py``, ``packing.py``, ``scoring.py``), the update loop
(``update.py``) and its step guard (``step_guard.py``), AdamW's state carried between updates
(``optimizer_state.py``, per rank: ``optimizer_shards.py``), the process group (``distributed.py``), LoRA
adapters (``lora.py``) and their merge (``merge.py``), and the engine-versus-trainer check (``probe.py``)."""
