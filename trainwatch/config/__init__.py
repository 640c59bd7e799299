"""Reading what users write: YAML config files (``yamlfile``), typed config models
(``model``), their JSON Schemas (``schema``) and command-line value types (``clitypes``);
each error names the file or option, the key and the line (exit 2)."""
