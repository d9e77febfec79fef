"""The one compiled module: the message walk of the OpenAI-chat fast path (see `offline_agent/_speedups.c`).

Everything else is in pyproject.toml. `optional=True`: where no C compiler is there, the install
goes on and ingestion uses the same walk in Python (`openai_chat.walk_messages`), about 2x slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "offline_agent._speedups",
            ["offline_agent/_speedups.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
