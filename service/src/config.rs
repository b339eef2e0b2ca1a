//! Loading the configuration: the file, then the process environment.

use schemas::settings::{Settings, SettingsError};
use std::path::Path;

/// Reads `path` (if any), applies the `BAGSTORE_…` variables of the
/// process environment on top, validates (`Settings::from_toml_and_env`).
pub fn load(path: Option<&Path>) -> Result<Settings, SettingsError> {
    let text = match path {
        Some(p) => std::fs::read_to_string(p)
            .map_err(|source| SettingsError::Read { path: p.display().to_string(), source })?,
        None => String::new(),
    };
    Settings::from_toml_and_env(&text, std::env::vars())
}
