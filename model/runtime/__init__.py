"""Running a model for the faces: the engine (one thread owns every MLX call), one turn
as a generator of events and its pieces (the conversation's cache, stop strings,
statistics, the attention watch), the engine's process wrapper and client, the generation
loop, sampling, constrained decoding (grammars for structured output and forced tool
calls), the events the engine emits, and BLAS thread control."""
