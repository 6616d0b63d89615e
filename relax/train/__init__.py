"""The trainer core every algorithm shares: state, optimizer, the generic update, primitives,
checkpoints, logs, health guards and the run loop (docs/architecture.md, "The update")."""
