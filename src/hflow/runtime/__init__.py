"""hflow.runtime: the single controller and its workers' side of RPC.

`launcher` (`hflow.launch`: torchrun's environment, the flags, rank 0's `main`), `controller`
(`Cluster`, `WorkerGroup`, futures, failure detection and shutdown), `dispatch` (how a call fans
out over a group and comes back), `server` (each rank's executor of the controller's tasks),
`transport` (RPC in one module), `stopping` (Ctrl-C / SIGTERM without losing the step).
"""
