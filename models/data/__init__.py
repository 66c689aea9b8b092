"""The data a run moves, with no Flyte in it: the rollout batch (``batch``: the Arrow file of one
iteration's episodes; ``batch_schema``: its columns and metadata) and the prompt dataset
(``prompts``: the split and its encoding; ``prompt_sources``: reading the user's files;
``prompt_render``: chat templates and checks). ``tasks/batch_type.py`` makes a batch a Flyte type."""
