"""Reading a family's networks from a diffusers pipeline folder, shared by every lineage: the folder checks,
`load_pretrained` and a network's compute dtype (`pretrained`), filling a network built on the meta device from the
folder's safetensors files, tensor by tensor (`checkpoint_files`: the trainer's sharded load and the engine's direct
load), and networks built from the configs alone for the planner (`configs_only`). No family's own code."""
