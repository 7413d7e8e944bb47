//! Argument definitions (clap derive). Defaults follow llama.cpp where a user would expect them to.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "infer",
    version,
    about = "Run quantized GGUF language models on this machine"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate a continuation of a prompt
    Run(RunArgs),
    /// Print the token ids of a text as a JSON array
    Tokenize(TokenizeArgs),
}

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// GGUF model file
    #[arg(short, long, value_name = "FILE")]
    pub model: PathBuf,
    /// Threads for computation (default: the number of physical cores)
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text; `-` reads it from stdin (also the default when stdin is piped)
    #[arg(short, long, conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// Feed token ids directly, comma-separated (no tokenization, no BOS added)
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Maximum tokens to generate
    #[arg(short = 'n', long = "max-tokens", default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 = greedy
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Keep only the K most likely tokens (0 = off)
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability sums to P (1 = off)
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0 = off)
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalize tokens seen in the last 64 (1 = off)
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Random seed (default: from the clock)
    #[arg(long)]
    pub seed: Option<u64>,
    /// Context size in tokens (default: 4096, at most the model's training context)
    #[arg(short, long)]
    pub ctx: Option<usize>,
    /// Stop when this text appears (repeatable); it is not printed
    #[arg(long = "stop", value_name = "STR")]
    pub stop: Vec<String>,
    /// Do not add the BOS token even if the model asks for it
    #[arg(long)]
    pub no_bos: bool,
    /// One JSON object per line: per token {"id","text"}, then a summary
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text to tokenize (`-` or absent: read stdin)
    pub text: Option<String>,
    /// Do not add BOS even if the model asks for it
    #[arg(long)]
    pub no_bos: bool,
    /// Treat special-token text like `<|im_start|>` as plain text
    #[arg(long)]
    pub no_special: bool,
    /// Read one JSON string per stdin line; write one JSON array of ids per line
    #[arg(long, conflicts_with = "text")]
    pub jsonl: bool,
}
