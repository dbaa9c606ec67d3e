//! Files from the Hugging Face Hub, through its local cache first.
//!
//! The cache is the standard one shared with Python's `huggingface_hub`: `HF_HUB_CACHE`, else
//! `HF_HOME/hub`, else `~/.cache/huggingface/hub`, laid out as
//! `models--org--name/refs/<revision>` (holding a commit hash) and
//! `models--org--name/snapshots/<commit>/<file>`. A file found there is used without touching the
//! network; with `HF_HUB_OFFLINE=1` a file not found there is an error that says where it looked.
//! Downloads go through `hf-hub`'s sync API (the `ureq` backend `tokenizers` itself uses).

use std::path::{Path, PathBuf};

use hf_hub::{Cache, Repo, RepoType};

use crate::error::{Error, Result};

/// A model repository and revision: `org/name` (revision `main`) or `org/name@revision`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoRef {
    /// The repository, `org/name`.
    pub id: String,
    /// The revision: a branch, tag or commit (default `main`).
    pub revision: String,
}

impl RepoRef {
    /// Reads `name`, `org/name` or `org/name@revision`; an error says the accepted forms.
    pub fn parse(spec: &str) -> Result<Self> {
        let (id, revision) = match spec.split_once('@') {
            Some((id, rev)) => (id, rev),
            None => (spec, "main"),
        };
        let valid = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
                && !s.starts_with('/')
                && !s.ends_with('/')
                && !s.contains("..")
        };
        if !valid(id) || id.matches('/').count() > 1 || !valid(revision) {
            return Err(Error::Config(format!(
                "`{spec}` is not a Hub model id: use `name`, `org/name` or `org/name@revision`"
            )));
        }
        Ok(Self {
            id: id.into(),
            revision: revision.into(),
        })
    }

    fn repo(&self) -> Repo {
        Repo::with_revision(self.id.clone(), RepoType::Model, self.revision.clone())
    }
}

impl std::fmt::Display for RepoRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.id, self.revision)
    }
}

/// Where Hub files are looked up, and whether the network may be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubSource {
    /// The Hugging Face cache folder (`HF_HUB_CACHE` layout).
    pub cache_dir: PathBuf,
    /// Whether only the cache may be read (`HF_HUB_OFFLINE`).
    pub offline: bool,
}

fn truthy(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

impl HubSource {
    /// From the environment: `HF_HUB_CACHE`, `HF_HOME`, `HF_HUB_OFFLINE`.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var_os(k).map(PathBuf::from);
        Self::from_vars(
            var("HF_HUB_CACHE"),
            var("HF_HOME"),
            std::env::var("HF_HUB_OFFLINE").ok().as_deref(),
        )
    }

    /// The rules of [`HubSource::from_env`] applied to given values: `HF_HUB_CACHE` wins, else
    /// `HF_HOME/hub`, else `~/.cache/huggingface/hub`; offline for `HF_HUB_OFFLINE` of
    /// 1, true, yes or on.
    pub fn from_vars(
        hub_cache: Option<PathBuf>,
        hf_home: Option<PathBuf>,
        offline: Option<&str>,
    ) -> Self {
        let cache_dir = match (hub_cache, hf_home) {
            (Some(dir), _) => dir,
            (None, Some(home)) => home.join("hub"),
            (None, None) => Cache::default().path().clone(),
        };
        Self {
            cache_dir,
            offline: offline.is_some_and(truthy),
        }
    }

    /// The cached copy of `file` in `repo`, if there is one (no network).
    pub fn cached(&self, repo: &RepoRef, file: &str) -> Option<PathBuf> {
        let is_commit =
            repo.revision.len() == 40 && repo.revision.chars().all(|c| c.is_ascii_hexdigit());
        let folder = self.cache_dir.join(repo.repo().folder_name());
        let commit = if is_commit {
            repo.revision.clone()
        } else {
            // refs/<revision> holds the commit; tools that write it by hand often end it with
            // a newline, which names no snapshot unless trimmed.
            let refs = folder.join("refs").join(&repo.revision);
            let text = crate::io::read_text_bounded(&refs, 4096, "Hugging Face ref").ok()?;
            text.trim().to_string()
        };
        if commit.is_empty() || commit.contains(['/', '\\']) || commit.starts_with('.') {
            return None;
        }
        // Whatever is there is the cached copy: a link to a device or a folder is reported by
        // its reader as what it is, not as missing.
        let path = folder.join("snapshots").join(commit).join(file);
        path.symlink_metadata().is_ok().then_some(path)
    }

    /// The local path of `file` in `repo`: from the cache, else downloaded into it (unless
    /// offline).
    pub fn fetch(&self, repo: &RepoRef, file: &str) -> Result<PathBuf> {
        if let Some(path) = self.cached(repo, file) {
            return Ok(path);
        }
        let folder = self.cache_dir.join(repo.repo().folder_name());
        if self.offline {
            return Err(Error::Input(format!(
                "{file} of {repo} is not in the Hugging Face cache ({}) and HF_HUB_OFFLINE is set: \
                 run once with network access, or put the file under {}/snapshots/<commit>/ with \
                 refs/{} naming the commit",
                self.cache_dir.display(),
                folder.display(),
                repo.revision
            )));
        }
        let api = hf_hub::api::sync::ApiBuilder::from_cache(Cache::new(self.cache_dir.clone()))
            .with_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .build()
            .map_err(|e| Error::Input(format!("cannot reach the Hugging Face Hub: {e}")))?;
        api.repo(repo.repo()).get(file).map_err(|e| {
            Error::Input(format!(
                "cannot download {file} of {repo} from the Hugging Face Hub ({e}); check the id and \
                 revision, the network, or set HF_HUB_OFFLINE=1 to use only the cache at {}",
                self.cache_dir.display()
            ))
        })
    }
}

/// Lays out `file` in a cache as the Hub client would, for tests and for seeding a cache by hand:
/// `models--org--name/snapshots/<commit>/<file>` and `refs/<revision>`.
pub fn place_in_cache(
    cache_dir: &Path,
    repo: &RepoRef,
    commit: &str,
    file: &str,
    bytes: &[u8],
) -> Result<PathBuf> {
    let folder = cache_dir.join(repo.repo().folder_name());
    let snapshot = folder.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).map_err(|e| Error::io(&snapshot, e))?;
    let path = snapshot.join(file);
    crate::io::write_atomic(&path, bytes)?;
    crate::io::write_atomic(&folder.join("refs").join(&repo.revision), commit.as_bytes())?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_references_parse() {
        assert_eq!(
            RepoRef::parse("bert-base-uncased").unwrap(),
            RepoRef {
                id: "bert-base-uncased".into(),
                revision: "main".into()
            }
        );
        let r = RepoRef::parse("org/name@v1.0").unwrap();
        assert_eq!((r.id.as_str(), r.revision.as_str()), ("org/name", "v1.0"));
        for bad in ["", "a/b/c", "/x", "x@", "a b", "../etc"] {
            let e = RepoRef::parse(bad).unwrap_err().to_string();
            assert!(e.contains("org/name@revision"), "{bad}: {e}");
        }
    }
}
