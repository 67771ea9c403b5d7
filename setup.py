"""Maps the top-level folders under the ``keyedstate`` import root; all metadata is in pyproject.toml.

``keyedstate`` itself is a namespace package (PEP 420): it has no folder of its own.
"""

from setuptools import find_namespace_packages, setup

FOLDERS = ("common", "jobmanager", "taskmanager", "state_processor", "cli", "examples")

setup(
    packages=[
        f"keyedstate.{name}"
        for name in find_namespace_packages(include=[f"{f}" for f in FOLDERS] + [f"{f}.*" for f in FOLDERS])
        if "__pycache__" not in name
    ],
    package_dir={f"keyedstate.{f}": f for f in FOLDERS},
    package_data={
        "keyedstate.common": ["py.typed"],
        # The REST API's OpenAPI document and the web page (jobmanager/rest/).
        "keyedstate.jobmanager": ["rest/openapi.json", "rest/static/*"],
    },
)
