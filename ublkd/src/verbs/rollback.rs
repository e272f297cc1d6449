//! Rollback: every step of a mount registers its undo; a failure runs them newest first.

use anyhow::Result;

/// Undo actions, run newest first unless disarmed.
pub type Undo = Box<dyn FnOnce() -> Result<()>>;
pub struct Rollback(Vec<(String, Undo)>);

impl Default for Rollback {
    fn default() -> Self {
        Self::new()
    }
}

impl Rollback {
    pub fn new() -> Rollback {
        Rollback(Vec::new())
    }

    pub fn push(&mut self, what: impl Into<String>, f: impl FnOnce() -> Result<()> + 'static) {
        self.0.push((what.into(), Box::new(f)));
    }
    pub fn disarm(mut self) {
        self.0.clear();
    }
}

impl Drop for Rollback {
    fn drop(&mut self) {
        while let Some((what, f)) = self.0.pop() {
            if let Err(e) = f() {
                eprintln!("ublkd: rollback: {what}: {e:#}");
            }
        }
    }
}
