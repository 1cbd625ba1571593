//! A model's adapter table as the gateway uses it: checked ([`check`]), then turned into a
//! [`Catalog`] looked up by name, without the adapters whose name is taken by a model.

use std::{collections::HashMap, sync::Arc};

use hearth_crds::llmadapter::{ADAPTERS_KEY, AdapterTable};

/// Why an adapter table was refused. The table in force stays.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdapterTableError {
    /// The JSON does not parse into an [`AdapterTable`].
    #[error(
        "{path}: {message} (the adapter table is the JSON of hearth_crds::llmadapter::AdapterTable)"
    )]
    Json {
        /// The JSON path of the value at fault (`adapters[2].path`), `.` for the document.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A value is out of range, or two entries have one name.
    #[error("{path}: {message}")]
    Invalid {
        /// The JSON path of the value at fault (`maxLoaded`, `adapters[1].name`).
        path: String,
        /// What is wrong and what it must be.
        message: String,
    },
    /// The ConfigMap exists without the table's key.
    #[error("the ConfigMap has no key {ADAPTERS_KEY:?}; it must hold the adapter table as JSON")]
    MissingKey,
    /// A shared gateway takes each model's adapters from its route table.
    #[error(
        "this gateway is shared (--routes-configmap): each model's adapters come from its route table (ModelRoute.adapters)"
    )]
    Shared,
}

impl AdapterTableError {
    /// The JSON path of the value at fault, when there is one.
    pub fn path(&self) -> Option<&str> {
        match self {
            Self::Json { path, .. } | Self::Invalid { path, .. } => Some(path),
            Self::MissingKey | Self::Shared => None,
        }
    }
}

/// Parses an adapter table from its JSON (the ConfigMap's [`ADAPTERS_KEY`]).
///
/// # Errors
/// [`AdapterTableError::Json`] with the path of the value that does not fit.
pub fn parse_adapter_table(json: &str) -> Result<AdapterTable, AdapterTableError> {
    crate::configmap::parse_table(json)
        .map_err(|(path, message)| AdapterTableError::Json { path, message })
}

fn invalid(path: impl Into<String>, message: impl Into<String>) -> AdapterTableError {
    AdapterTableError::Invalid {
        path: path.into(),
        message: message.into(),
    }
}

/// Checks `table`: the load and unload calls absolute paths, `maxLoaded` at least 1, every
/// adapter with a name and a path, names unique, an `unavailable` message not empty when
/// present.
///
/// # Errors
/// [`AdapterTableError::Invalid`] naming the first field at fault, its path relative to the
/// table (`adapters[2].name`).
pub fn check(table: &AdapterTable) -> Result<(), AdapterTableError> {
    for (field, path) in [
        ("loadPath", &table.load_path),
        ("unloadPath", &table.unload_path),
    ] {
        if !path.starts_with('/') || path.parse::<http::uri::PathAndQuery>().is_err() {
            return Err(invalid(
                field,
                format!("{path:?} must be an absolute path, like \"/v1/load_lora_adapter\""),
            ));
        }
    }
    if table.max_loaded == 0 {
        return Err(invalid(
            "maxLoaded",
            "must be at least 1: the adapters one engine keeps loaded at once",
        ));
    }
    let mut names: HashMap<&str, usize> = HashMap::new();
    for (i, a) in table.adapters.iter().enumerate() {
        if a.name.trim().is_empty() {
            return Err(invalid(format!("adapters[{i}].name"), "must not be empty"));
        }
        if a.path.trim().is_empty() {
            return Err(invalid(
                format!("adapters[{i}].path"),
                "must not be empty: the adapter's directory as the engine sees it",
            ));
        }
        if a.unavailable.as_ref().is_some_and(|m| m.trim().is_empty()) {
            return Err(invalid(
                format!("adapters[{i}].unavailable"),
                "must not be empty when present: the message clients get while the adapter cannot be loaded (leave it out when it can)",
            ));
        }
        if let Some(j) = names.insert(&a.name, i) {
            return Err(invalid(
                format!("adapters[{i}].name"),
                format!(
                    "{:?} is also the name of adapters[{j}]: adapter names are unique",
                    a.name
                ),
            ));
        }
    }
    Ok(())
}

/// One adapter clients may call by its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adapter {
    /// The `model` clients send, and the engine's `lora_name`.
    pub name: Arc<str>,
    /// The adapter's directory as the engine sees it (`lora_path`).
    pub path: String,
    /// `<namespace>/<name>` of the LLMAdapter.
    pub object: String,
    /// Why the engines cannot load it yet (its route's `unavailable`): its requests are
    /// answered `503` at once, without a load. `None` when it can be loaded.
    pub unavailable: Option<String>,
}

/// A model's adapters, by name, with the engine's load and unload calls.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Catalog {
    load_path: String,
    unload_path: String,
    max_loaded: usize,
    /// In the table's order (sorted by name).
    adapters: Vec<Arc<Adapter>>,
    by_name: HashMap<Arc<str>, Arc<Adapter>>,
}

impl Catalog {
    /// The catalog of `table` (checked by [`check`]) less the adapters whose name `taken`
    /// says is another's (a model's): a model wins over an adapter of its name. Returns the
    /// names left out too.
    pub fn new(table: &AdapterTable, taken: impl Fn(&str) -> bool) -> (Self, Vec<String>) {
        let mut clashes = Vec::new();
        let mut adapters = Vec::with_capacity(table.adapters.len());
        let mut by_name = HashMap::with_capacity(table.adapters.len());
        for a in &table.adapters {
            if taken(&a.name) {
                clashes.push(a.name.clone());
                continue;
            }
            let adapter = Arc::new(Adapter {
                name: Arc::from(a.name.as_str()),
                path: a.path.clone(),
                object: a.adapter.clone(),
                unavailable: a.unavailable.clone(),
            });
            by_name.insert(adapter.name.clone(), adapter.clone());
            adapters.push(adapter);
        }
        let catalog = Self {
            load_path: table.load_path.clone(),
            unload_path: table.unload_path.clone(),
            max_loaded: usize::try_from(table.max_loaded).unwrap_or(usize::MAX),
            adapters,
            by_name,
        };
        (catalog, clashes)
    }

    /// Whether it holds no adapter.
    pub fn is_empty(&self) -> bool {
        self.adapters.is_empty()
    }

    /// The adapters, in the table's order.
    pub fn adapters(&self) -> &[Arc<Adapter>] {
        &self.adapters
    }

    /// The adapter called `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<Adapter>> {
        self.by_name.get(name)
    }

    /// The engine's load call (`POST`, `{"lora_name", "lora_path"}`).
    pub fn load_path(&self) -> &str {
        &self.load_path
    }

    /// The engine's unload call (`POST`, `{"lora_name"}`).
    pub fn unload_path(&self) -> &str {
        &self.unload_path
    }

    /// Adapters one engine keeps loaded at once.
    pub fn max_loaded(&self) -> usize {
        self.max_loaded
    }
}

#[cfg(test)]
mod tests {
    use hearth_crds::llmadapter::AdapterRoute;

    use super::*;

    fn route(name: &str) -> AdapterRoute {
        AdapterRoute {
            name: name.into(),
            path: format!("/adapters/{name}"),
            adapter: format!("ns/{name}"),
            unavailable: None,
        }
    }

    fn table(adapters: Vec<AdapterRoute>) -> AdapterTable {
        AdapterTable {
            load_path: "/v1/load_lora_adapter".into(),
            unload_path: "/v1/unload_lora_adapter".into(),
            max_loaded: 2,
            adapters,
        }
    }

    #[test]
    fn a_table_out_of_range_names_its_field() {
        assert_eq!(check(&table(vec![route("a"), route("b")])), Ok(()));
        let fetching = AdapterRoute {
            unavailable: Some("its files are being fetched".into()),
            ..route("c")
        };
        assert_eq!(check(&table(vec![route("a"), fetching])), Ok(()));
        let cases: Vec<(AdapterTable, &str)> = vec![
            (
                AdapterTable {
                    load_path: "v1/load".into(),
                    ..table(vec![])
                },
                "loadPath",
            ),
            (
                AdapterTable {
                    unload_path: String::new(),
                    ..table(vec![])
                },
                "unloadPath",
            ),
            (
                AdapterTable {
                    max_loaded: 0,
                    ..table(vec![])
                },
                "maxLoaded",
            ),
            (
                table(vec![AdapterRoute {
                    name: " ".into(),
                    ..route("a")
                }]),
                "adapters[0].name",
            ),
            (
                table(vec![
                    route("a"),
                    AdapterRoute {
                        path: String::new(),
                        ..route("b")
                    },
                ]),
                "adapters[1].path",
            ),
            (table(vec![route("a"), route("a")]), "adapters[1].name"),
            (
                table(vec![AdapterRoute {
                    unavailable: Some(" ".into()),
                    ..route("a")
                }]),
                "adapters[0].unavailable",
            ),
        ];
        for (t, path) in cases {
            let e = check(&t).unwrap_err();
            assert_eq!(e.path(), Some(path), "{e}");
        }
    }

    #[test]
    fn json_that_does_not_fit_names_its_path() {
        let e = parse_adapter_table(r#"{"loadPath": "/l", "unloadPath": "/u", "maxLoaded": -1}"#)
            .unwrap_err();
        assert_eq!(e.path(), Some("maxLoaded"), "{e}");
        let t = table(vec![route("a")]);
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(parse_adapter_table(&json).unwrap(), t);
    }

    #[test]
    fn a_model_wins_over_an_adapter_of_its_name() {
        let (c, clashes) = Catalog::new(&table(vec![route("a"), route("base")]), |n| n == "base");
        assert_eq!(clashes, ["base"]);
        assert!(c.get("base").is_none());
        assert_eq!(c.get("a").map(|a| a.path.as_str()), Some("/adapters/a"));
        assert_eq!(c.adapters().len(), 1);
        assert_eq!(c.max_loaded(), 2);
        assert!(!c.is_empty() && Catalog::default().is_empty());
    }
}
