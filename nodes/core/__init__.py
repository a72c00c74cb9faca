"""What every node family and the server share: the adapters to ComfyUI's core (its loaded models,
its pinned memory, its prompt queue, its host moves), what a user's numbers mean (budgets), the
server owner's settings file, and the pack's process-wide state (state.py, the only place its
registries are made).
May import: the engine (offload_core), and nothing else of nodes/."""
