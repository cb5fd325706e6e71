//! fio's job file syntax: `[section]` headers, `key=value` lines, `[global]`
//! inheritance.

use super::{JobSpec, OptionError, RawOption};

/// One section of a job file, with its options in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    /// Section name (`global` or a job name).
    pub name: String,
    /// Options in the order written.
    pub options: Vec<RawOption>,
}

/// Parses fio's INI-like job file syntax: `[section]`, `key=value`, bare `key` (a boolean),
/// comments starting with `#` or `;`.
pub fn parse_job_file(text: &str) -> Result<Vec<Section>, OptionError> {
    let mut sections: Vec<Section> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(rest) = line.strip_prefix('[') {
            let name = rest
                .strip_suffix(']')
                .map(str::trim)
                .filter(|n| !n.is_empty());
            let Some(name) = name else {
                return Err(OptionError::Syntax {
                    line: i + 1,
                    text: raw.to_string(),
                });
            };
            sections.push(Section {
                name: name.to_string(),
                options: Vec::new(),
            });
            continue;
        }
        let Some(section) = sections.last_mut() else {
            return Err(OptionError::Syntax {
                line: i + 1,
                text: raw.to_string(),
            });
        };
        let (k, v) = match line.split_once('=') {
            Some((k, v)) => (k.trim(), Some(v.trim().to_string())),
            None => (line, None),
        };
        if k.is_empty() || k.contains(char::is_whitespace) {
            return Err(OptionError::Syntax {
                line: i + 1,
                text: raw.to_string(),
            });
        }
        section.options.push((k.to_string(), v));
    }
    Ok(sections)
}

/// Turns job file sections into job descriptions: each `[global]` section adds to the
/// options inherited by the job sections after it; `extra_global` (command-line job
/// options) is applied after the file's globals and before each section's own options.
pub fn jobs_from_sections(
    sections: &[Section],
    extra_global: &[RawOption],
) -> Result<Vec<JobSpec>, OptionError> {
    let mut global: Vec<RawOption> = Vec::new();
    let mut jobs = Vec::new();
    for s in sections {
        if s.name == "global" {
            global.extend(s.options.iter().cloned());
            continue;
        }
        let mut opts = global.clone();
        opts.extend(extra_global.iter().cloned());
        opts.extend(s.options.iter().cloned());
        jobs.push(JobSpec::from_options(&s.name, &opts)?);
    }
    if jobs.is_empty() {
        return Err(OptionError::Conflict(
            "the job file defines no job (only [global] sections)".to_string(),
        ));
    }
    Ok(jobs)
}
