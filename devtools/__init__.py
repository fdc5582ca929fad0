"""Development fixtures, not the engine or the services: tiny demo models and adapters with a
trained tokenizer (`demo_assets`), random adapters for tests and benchmarks (`synthetic`), and
a whole local stack as child processes (`demo_stack`, used by `slora up` and the tests).
Imports `slora_core` and `services`; nothing there imports it except the CLI commands."""
