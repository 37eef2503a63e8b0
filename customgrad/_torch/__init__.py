"""torch's private API, one adapter module per concept; nothing else in customgrad names it.

customgrad needs a few things torch has no public API for. Each is read here, once, detected
per torch version (customgrad supports torch 2.11-2.15), with a fallback that is slower or
more general, never wrong:

- :mod:`~customgrad._torch.engine`: the autograd engine while it runs a backward (which edges
  the graph task will execute, the running node, the graph task's id, ``retain_graph``, what
  ``torch.autograd.grad`` captures);
- :mod:`~customgrad._torch.dispatcher`: the dispatcher and ``torch.library`` (op overload types,
  dispatch keys and guards, the registrations ``torch.library`` keeps, schema parsing, the
  modes, transforms and profiler that would see a dispatcher call);
- :mod:`~customgrad._torch.transforms`: functorch transforms and forward-mode AD levels;
- :mod:`~customgrad._torch.functions`: ``torch.autograd.Function`` internals (a node's Function
  class, the backward node class, ``apply`` without functorch's wrapper);
- :mod:`~customgrad._torch.fake`: fake and functional tensors and fake modes;
- :mod:`~customgrad._torch.aot` and :mod:`~customgrad._torch.dynamo`: AOTAutograd, inductor
  and dynamo names a split-aware compile backend reads;
- :mod:`~customgrad._torch.pipelining`: private members of ``torch.distributed.pipelining``;
- :mod:`~customgrad._torch.errors`: how dynamo and AOTAutograd wrap what is raised while they
  trace, and the error inside.

``tests/test_torch_internals.py`` pins each adapter: it fails loudly when a torch upgrade
changes a name or a behaviour read here, so an upgrade cannot make customgrad silently slower
or wrong. Import the submodule for the concept (``from customgrad._torch import engine``).
"""
