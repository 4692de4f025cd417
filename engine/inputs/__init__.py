"""What goes into and comes out of the model as text: resolving a model folder or hub id
(with a table of well-known configs for dummy weights), turning prompts and audio into
encoder inputs, and incremental detokenisation."""
