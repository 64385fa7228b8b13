//! A load job's include/exclude globs. A pattern without `/` matches the file name at any depth;
//! one with `/` matches the path relative to the job's path (`**` spans directories). A file is
//! loaded when it matches some include (or none is given) and no exclude.

use globset::{GlobSet, GlobSetBuilder};
use thiserror::Error;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum FilterError {
    #[error("bad glob {pattern:?}: {source}")]
    BadGlob { pattern: String, source: globset::Error },
    #[error(transparent)]
    Set(globset::Error),
}

pub struct Filter {
    include_names: GlobSet,
    include_paths: GlobSet,
    exclude_names: GlobSet,
    exclude_paths: GlobSet,
    any_include: bool,
}

impl Filter {
    pub fn new(include: &[String], exclude: &[String]) -> Result<Self, FilterError> {
        let build = |patterns: &[String], with_slash: bool| -> Result<GlobSet, FilterError> {
            let mut b = GlobSetBuilder::new();
            for p in patterns.iter().filter(|p| p.contains('/') == with_slash) {
                let glob = globset::GlobBuilder::new(p.trim_start_matches('/'))
                    .literal_separator(true)
                    .build()
                    .map_err(|source| FilterError::BadGlob { pattern: p.clone(), source })?;
                b.add(glob);
            }
            b.build().map_err(FilterError::Set)
        };
        Ok(Self {
            include_names: build(include, false)?,
            include_paths: build(include, true)?,
            exclude_names: build(exclude, false)?,
            exclude_paths: build(exclude, true)?,
            any_include: !include.is_empty(),
        })
    }

    pub fn accepts(&self, rel: &str) -> bool {
        let name = rel.rsplit('/').next().unwrap_or(rel);
        let hit = |names: &GlobSet, paths: &GlobSet| names.is_match(name) || paths.is_match(rel);
        (!self.any_include || hit(&self.include_names, &self.include_paths))
            && !hit(&self.exclude_names, &self.exclude_paths)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_names_anywhere_and_paths_from_the_job_root() {
        let f = Filter::new(&["*.bin".into()], &["skip/**".into()]).unwrap();
        assert!(f.accepts("a.bin"));
        assert!(f.accepts("deep/dir/a.bin"));
        assert!(!f.accepts("a.txt"));
        assert!(!f.accepts("skip/x/a.bin"));
        let all = Filter::new(&[], &["*.tmp".into()]).unwrap();
        assert!(all.accepts("x/y"));
        assert!(!all.accepts("x/y.tmp"));
        assert!(Filter::new(&["a[".into()], &[]).err().is_some_and(|e| e.to_string().contains("bad glob")));
    }
}
