"""The server of `diff-transformer serve`: transformers' own OpenAI-compatible server (`transformers serve`) for Diff
models, with what it lacks for them and for clients.

transformers 5.23's server looks the model class up by name on the `transformers` package
(`getattr(transformers, config.architectures[0])` in `transformers/cli/serving/model_manager.py`), so it only loads
architectures that transformers ships: `transformers serve --trust-remote-code` fails on every custom-code
checkpoint with "module transformers has no attribute DiffForCausalLM"; and it loads a Hub repo's pickled weights.
`diff-transformer serve` (`cli/serve.py`, the command) imports diff_transformer (which registers the Auto classes),
installs what follows (`patches.install`: every patch of transformers' server is a row of one table,
`patches.PATCHES`, applied from one `ServeSettings`), among them a model manager that loads a Diff model through the
one road every command takes (`checkpoints.open(...).load()`: safetensors only, the package's classes), and then runs
transformers' `serve` command in this process with the same options (`diff-transformer serve --help`).

What transformers' server does not bound, this package does (`server.bounded_generation`, the "uvicorn" patch):

* `max_tokens` (`max_completion_tokens`, `max_output_tokens`): transformers generates as many tokens as a request
  asks (and 1024 by default). Here every generation is clamped to the model's context (`max_position_embeddings`
  minus the prompt) and to `--max-new-tokens-limit N` when given; the answer then ends with finish_reason "length".
  A prompt that already fills the context is refused (HTTP 400).
* A client that disconnects: transformers cancels a *streaming* generation at its next token; a non-streaming one
  runs to its end, which the clamp above bounds.
* Queued work: transformers' plain server runs one `generate` at a time per model, first come first served, without
  bound (a 3-token request waited 101 s behind 16 long ones). At most --max-queued-requests requests are in the server
  at once (`server.QueueBound`); one more is answered 429 with Retry-After.
* Loaded models: transformers keys a model by "name@revision" and holds it until --model-timeout passes idle, so each
  made-up revision of a local directory loaded another copy. A revision of a local directory is refused
  (`models.local_revision_problem`), and loading past --max-loaded-models unloads the least recently used model that
  no request is using.
* Concurrent loads: transformers locks per model, so two models were built at once (`from_pretrained` is not
  thread-safe: answers of garbage with HTTP 200) and a model was unloaded under a request. Every build and drop of a
  model runs under one lock, and a request pins its model until its answer is sent (`models.diff_model_manager`).
* SIGTERM: uvicorn then waits for the requests in flight without limit; here for 5 s, after which they are cancelled
  and the process exits (the generation thread is a daemon).
* `serve MODEL` with a MODEL that does not exist: one line, exit status 2, before the server starts.
* A model's config.json is held against its weights before it is built (`check_config_against_weights`; a config
  claiming 10^5 layers kept transformers building for minutes), and a model directory with weights but no tokenizer
  is refused: one line at start-up (`serve MODEL`), else a 400 when a request names it
  (`models.check_model_directory`).
* Chat templates render within bounds (`generation.chat_templates`: 2 s, 5,000,000 steps, 4 Mi characters), in a
  worker thread (`server.render_off_the_loop`): transformers renders on the event loop, where a template with nested
  loops held up every request, /health included. One past its bound answers 400. The render itself runs in a worker
  process (`render_pool`: address space capped, killed past its time), as one C call building gigabytes held the
  server's GIL.
* Request bodies over --max-request-bytes are answered 413 before they are buffered, and the queue bound counts a
  request from its arrival; Retry-After is the work ahead of it (`server.QueueBound.retry_after`).

What clients rely on and transformers' server gets wrong, this package fixes (`models.diff_model_manager`,
`server.openai_errors`, `models.check_pinned`, and `requests`: request fields, `stop`, response names, `[DONE]`):

* `GET /v1/models` lists the pinned model (`serve MODEL`), else the loaded ones and the Hub cache's LLMs; transformers
  answers 500 when the Hub cache folder does not exist, and never lists a Diff model.
* A request naming a model that does not exist (or, on a pinned server, another model) answers 404 at once, one
  that cannot be loaded 400 (transformers retried the Hub for ~2 minutes, then answered a bare 500); the error body is
  OpenAI's `{"error": {"message", "type", "param", "code"}}`, also for a 500.
* Request fields are checked before anything runs (`requests.check_request`): `max_tokens: 0`, a seed torch
  cannot take, a malformed `logit_bias` or `messages` were plain-text 500s; `n` > 1 is refused (transformers ignores
  it).
* `stop` ends the answer before the stop string, finish_reason "stop" (transformers kept the stop text, and ignored
  `stop` under continuous batching); a response names the model as the request did (not "model@main"); a stream ends
  with `data: [DONE]`.
* A model is loaded in a thread of its own (`models.load_off_the_loop`): transformers loads it on the event loop, where
  every other request, /health included, waits for it.
* `--help` is this command's own: its options, then a note of what goes to transformers (`--transformers-help`).
"""
