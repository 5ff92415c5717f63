"""Tool calls for the OpenAI API, host side (no JAX): which parser a checkpoint gets (`choose`), the
parsers per model family that turn an output into content and calls, whole or streamed
(`parsers`: `hermes`, `llama3`, `mistral`; shared parts in `stream` and `marked`), the grammar
that forces a call for `tool_choice` "required" / a named function (`grammar`), and the checks on
a request's tools and tool messages (`validate`). Rendering tools into the prompt is the chat
template's (`pddjax.model.chat_template`)."""
