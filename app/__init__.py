"""The browser UI: Gradio Blocks wiring components to pipeline calls, nothing more."""
