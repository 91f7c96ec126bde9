"""The pipelines: a tool's work from a request to its answer, over whichever engine was chosen.

`chat` (messages → streamed text), `image_chat` (an image and messages → streamed text, MiniGPT-4),
`segment` (an image and prompts → SAM masks) and `segment_session` (one user's prompting on one
image). They use the model code and engines below them (`pipeline.llm`, `pipeline.sam`,
`pipeline.minigpt4`) and know nothing of front ends or of how the studio is put together.
"""
