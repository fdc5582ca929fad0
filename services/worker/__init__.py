"""The worker: serves InferenceService.Generate over one engine and follows placement."""
